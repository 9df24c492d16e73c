"""`pip install .[gateway]` / `.[operator]` in a fresh virtual environment install no torch.

Real pip, from the package registry, into a new venv (about 100 s each on a loaded 2-core machine:
marked ``slow``). The cheap guard that runs by default is
`tests/unit/test_layering.py::test_the_gateway_and_the_operator_import_without_the_model_stack`
(the same imports with the model stack blocked) and `tests/chart/test_images.py` (the requirements).
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODEL_STACK = {"torch", "diffusers", "safetensors", "tiktoken", "triton", "numpy"}

pytestmark = pytest.mark.slow
#: what the images COPY: the project's metadata and its packages
SOURCES = ("pyproject.toml", "README.md", "mammoth_core", "mammoth_app", "stage_ar", "stage_dit", "gateway",
           "operator/mammoth_operator")


def _source_copy(dest: pathlib.Path) -> pathlib.Path:
    """The project's sources copied to ``dest`` (pip builds in the source tree: not in this one)."""
    for name in SOURCES:
        src, dst = ROOT / name, dest / name
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    return dest


@pytest.mark.parametrize("extra, module", [("gateway", "gateway.app"), ("operator", "mammoth_operator.handlers")])
def test_a_fresh_install_of_the_extra_has_no_torch(tmp_path, extra, module):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    source = _source_copy(tmp_path / "src")
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", f"{source}[{extra}]"],
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True,
                            text=True, check=True, timeout=120).stdout
    names = {line.split("==")[0].lower() for line in listed.splitlines()}
    assert "mammoth-pipeline" in names
    assert names & MODEL_STACK == set(), sorted(names)
    # outside the source tree, so the installed package is what is imported
    run = subprocess.run([str(python), "-c", f"import {module}, mammoth_app.cli; print('ok')"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
    help_ = subprocess.run([str(venv / "bin" / "mammoth"), extra, "--help"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0, help_.stderr[-3000:]
