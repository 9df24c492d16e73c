"""Per-request trace files (the ``trace_dir`` setting): one JSON document per stage and attempt.

``<trace_dir>/<request_id>.e<epoch>.<stage>.json``; the AR writes ``ar`` (when each row left the
decode loop), the DiT ``dit`` (when each chunk arrived, and the transfer tail's phases). Off when
``trace_dir`` is unset. Each file appears whole (written beside it, then renamed), so a reader that
globs for ``*.<stage>.json`` never sees half a document.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any


def trace_path(trace_dir: str | os.PathLike, stage: str, request_id: str, epoch: int) -> pathlib.Path:
    """Where the ``stage`` trace of attempt ``(request_id, epoch)`` lives."""
    return pathlib.Path(trace_dir) / f"{request_id}.e{int(epoch)}.{stage}.json"


def write_request_trace(trace_dir: str | os.PathLike | None, stage: str, request_id: str, epoch: int,
                        body: dict[str, Any]) -> pathlib.Path | None:
    """Write ``{"request_id", "epoch", **body}`` as the ``stage`` trace of ``(request_id, epoch)``.

    Returns the file's path, or None when ``trace_dir`` is unset (nothing written).

    Raises:
        OSError: the folder is missing or not writable.
    """
    if not trace_dir:
        return None
    path = trace_path(trace_dir, stage, request_id, epoch)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"request_id": request_id, "epoch": int(epoch), **body}))
    os.replace(tmp, path)
    return path
