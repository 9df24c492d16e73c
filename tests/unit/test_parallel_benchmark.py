"""`benchmarks/parallel.py --tiny` (the issue-21 GPU benchmark) on the CPU: the whole run is `slow`
(about 2 minutes here: it starts rank processes and a pipeline); the default run checks its AR and DiT
sections on one rank in this process, which is the harness code the GPU run relies on."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def settings(tmp_path):
    from mammoth_app.make_checkpoint import materialize_checkpoint
    from mammoth_core.settings import ARSettings, DiTSettings

    ckpt = str(materialize_checkpoint("builtin://tiny", str(tmp_path)))
    common = {"checkpoint": ckpt, "cache_dir": str(tmp_path), "device": "cpu"}
    return ARSettings(**common, max_running_sequences=2), DiTSettings(**common)


def test_single_rank_sections_measure(settings):
    from benchmarks import parallel

    ar, dit = settings
    r = parallel.ar_ms_per_token(ar, 1, grid=2, steps=2)
    assert r["tp"] == 1 and r["ms_per_token"] > 0
    d = parallel.dit_ms_per_step(dit, "none", size=64, steps=1)
    assert d["mode"] == "none" and d["ms_per_step"] > 0


@pytest.mark.slow
def test_tiny_benchmark_runs_every_section(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "parallel.py"), "--tiny", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "parallel.json").read_text())
    assert {"ar_tp1", "ar_tp2", "dit_none", "dit_cfg", "dit_ulysses", "end_to_end"} <= set(res)
