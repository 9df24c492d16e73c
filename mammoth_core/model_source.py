"""Model sources: ``hf://org/repo@revision`` downloads for the init container.

``mammoth download-model hf://org/repo@revision DEST`` fetches the snapshot with
``huggingface_hub.snapshot_download`` into DEST (resumable; only the files a checkpoint needs:
configs, tokenizer, safetensors and index), then writes ``DEST/.complete``. A DEST that already has
``.complete`` for the same repo and revision is left as is, so pod restarts do not download again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import re

logger = logging.getLogger(__name__)

_HF = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.tiktoken", "*.txt"]


@dataclasses.dataclass(frozen=True)
class HFSource:
    """A parsed ``hf://org/repo@revision`` URI (revision defaults to ``main``)."""

    repo: str
    revision: str


def parse_hf_uri(uri: str) -> HFSource:
    """Parse ``hf://org/repo[@revision]``.

    Raises:
        ValueError: the URI is not of that form.
    """
    m = _HF.match(uri)
    if not m:
        hint = ""
        if "://" not in uri and _HF.match(f"hf://{uri}"):
            hint = f"; did you mean hf://{uri}?"
        raise ValueError(f"not an hf:// model URI: {uri!r} (expected hf://org/repo or "
                         f"hf://org/repo@revision{hint})")
    return HFSource(repo=m["repo"], revision=m["rev"] or "main")


def download_model(uri: str, dest: str) -> pathlib.Path:
    """Download ``uri`` into ``dest`` (see the module docstring); returns ``dest``.

    Raises:
        ValueError: unsupported URI.
        ImportError: ``huggingface_hub`` is not installed.
    """
    source = parse_hf_uri(uri)
    path = pathlib.Path(dest)
    marker = path / ".complete"
    if marker.is_file():
        done = json.loads(marker.read_text() or "{}")
        if done.get("repo") == source.repo and done.get("revision") == source.revision:
            logger.info("%s already holds %s@%s", path, source.repo, source.revision)
            return path
    from huggingface_hub import snapshot_download

    path.mkdir(parents=True, exist_ok=True)
    snapshot_download(
        repo_id=source.repo,
        revision=source.revision,
        local_dir=str(path),
        allow_patterns=ALLOW_PATTERNS,
    )
    marker.write_text(json.dumps({"repo": source.repo, "revision": source.revision}))
    logger.info("downloaded %s@%s to %s", source.repo, source.revision, path)
    return path
