"""Where the MammothModa2 tiny reference fixture lives, resolved in one place for every test.

Order: ``$MAMMOTH_TINY_REFERENCE``; then ``shared/fixtures/mammoth-tiny-reference`` beside the
repository (the developer checkout and CI both lay ``shared/`` there). When it is missing, tests that
need it skip locally but fail in CI (``CI`` set): a missing fixture must not pass silently.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_DIR = Path(
    os.environ.get("MAMMOTH_TINY_REFERENCE") or ROOT.parent / "shared" / "fixtures" / "mammoth-tiny-reference"
)
PRESENT = (REFERENCE_DIR / "tiny_reference.safetensors").is_file()
if not PRESENT and os.environ.get("CI"):
    raise RuntimeError(f"the reference fixture is missing from {REFERENCE_DIR} (set MAMMOTH_TINY_REFERENCE)")

#: ``pytestmark = requires_reference`` in modules that need the fixture.
requires_reference = pytest.mark.skipif(not PRESENT, reason=f"reference fixture not found in {REFERENCE_DIR}")
