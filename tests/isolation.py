"""What "a unit test reads nothing from outside the repository" means, in one place.

Used by ``tests/unit/conftest.py`` (every unit run: an empty ``HOME`` and cache, no skip but for
missing hardware) and by ``tests/integration/test_readme.py`` (the unit tests in an isolated fresh
clone, the ``slow`` run).
"""

from __future__ import annotations

import os
import pathlib

#: Skip reasons that mean "this machine lacks the hardware" (or, for the tests that run Triton's CPU
#: interpreter, has a GPU, where the interpreter is off), never "data is missing".
HARDWARE_SKIPS = ("needs CUDA", "has no bfloat16", "needs a CPU-only machine")


def is_hardware_skip(reason: str) -> bool:
    """True when a skip ``reason`` names missing hardware (one of :data:`HARDWARE_SKIPS`)."""
    return any(h in reason for h in HARDWARE_SKIPS)


def newcomer_env(home: pathlib.Path) -> dict[str, str]:
    """This session's environment without what a newcomer would not have (``MAMMOTH_*``, venvs),
    with ``XDG_CACHE_HOME`` under ``home`` (no built-in checkpoint from earlier runs)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MAMMOTH_", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CONDA"))}
    env["XDG_CACHE_HOME"] = str(home / ".cache")
    return env
