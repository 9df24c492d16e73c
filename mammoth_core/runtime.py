"""Process plumbing shared by the stage and gateway entry points."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any


def write_ready_file(path: str | None, address: str, **extra: Any) -> None:
    """Atomically write ``{"address": "host:port", "pid": ..., **extra}`` to ``path``.

    ``mammoth up`` passes ``--ready-file`` to each component and waits for this file, which is
    written only once the component is serving (model loaded, port open). No-op when ``path`` is None.
    """
    if not path:
        return
    tmp = pathlib.Path(path + ".tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid(), **extra}))
    os.replace(tmp, path)


def start_metrics_server(port: int, host: str) -> int:
    """Serve Prometheus metrics (default registry) on ``host:port``; returns the bound port.

    ``port`` 0 picks a free port; a negative ``port`` disables the server and returns -1.
    """
    if port < 0:
        return -1
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host)
    return int(server.server_port)
