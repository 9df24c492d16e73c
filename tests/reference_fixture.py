"""Where the MammothModa2 tiny reference fixture lives, resolved in one place for every test.

The fixture is part of the repository (``tests/fixtures/mammoth-tiny-reference``, provenance in its
``README.md``), so a fresh clone is self-sufficient: no test reads data from outside the repository,
and none skips for missing data. A missing file is an error at import time, never a skip.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_DIR = ROOT / "tests" / "fixtures" / "mammoth-tiny-reference"
if not (REFERENCE_DIR / "tiny_reference.safetensors").is_file():
    raise RuntimeError(f"the reference fixture is missing from {REFERENCE_DIR}: the repository is incomplete")
