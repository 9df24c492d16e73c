"""Fixtures shared by every test folder: the tiny checkpoint and a running local pipeline."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# kopf's operator package lives in operator/mammoth_operator (never a top-level `operator`).
if str(ROOT / "operator") not in sys.path:
    sys.path.insert(0, str(ROOT / "operator"))
# Shared test helpers (pipeline_harness) are imported by module name, not through `conftest`.
if str(ROOT / "tests") not in sys.path:
    sys.path.append(str(ROOT / "tests"))

# Without a GPU, Triton kernels (stage_ar.decode_attention) run in Triton's CPU interpreter; it is
# chosen when triton is imported, so before any test module imports it.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

from pipeline_harness import RunningPipeline, start_local_pipeline  # noqa: E402,F401


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> pathlib.Path:
    """A freshly written built-in tiny checkpoint (real layout, deterministic random weights),
    written once per run: pytest-xdist's workers share the first one's (their common temporary
    folder, under a file lock), where each worker once spent about 17 s building its own."""
    from filelock import FileLock

    from mammoth_app.make_checkpoint import make_checkpoint

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # one folder per run, shared by the workers
    target = root / "tiny-checkpoint"
    with FileLock(str(root / "tiny-checkpoint.lock")):
        if not target.is_dir():
            building = root / f"tiny-checkpoint.{os.getpid()}"
            make_checkpoint(building, "tiny")
            building.rename(target)  # complete or absent, never half written
    return target


@pytest.fixture(scope="module")
def inprocess_model(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint's whole model in this process (`mammoth_app.inprocess.InProcessModel`:
    no transport), with one torch thread for the module, as the local stages run (their bits depend
    on it); the thread count is restored afterwards. What served images are compared with."""
    import torch

    from mammoth_app.inprocess import InProcessModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield InProcessModel(str(tiny_checkpoint), str(tmp_path_factory.mktemp("cache")))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def pipeline(tiny_checkpoint, tmp_path_factory):
    """One local pipeline shared by the tests that do not disturb it (no kills, no drains)."""
    from mammoth_app.local import stop_pipeline

    running = start_local_pipeline(tiny_checkpoint, tmp_path_factory.mktemp("pipeline"))
    yield running
    stop_pipeline(list(running.components.values()))
