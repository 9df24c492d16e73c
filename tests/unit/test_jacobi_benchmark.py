"""`benchmarks/jacobi.py --tiny` runs end to end on CPU (the smoke test of the GPU benchmark)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_tiny_benchmark_runs_and_reports_every_section(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "jacobi.py"), "--tiny", "--grid", "2", "--window", "4",
         "--models", "1:1,16:0", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                                           "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "jacobi.json").read_text())
    assert set(res["window_cost_ms"]["eager"]) == {"b1_t1", "b1_t16", "b2_t1", "b2_t16"}
    assert res["window_cost_ms"]["graph"] == {}  # CUDA graphs on CUDA only
    decode = res["decode"]
    assert decode["sequential"]["forwards_per_token"] == 1.0
    # a prediction that depends on the position only: drafts are accepted, several tokens per forward
    assert decode["jacobi_s16_c0"]["forwards_per_token"] <= 0.5
    assert {"sweep_s16_c0.01_w2", "sweep_s16_c0.01_w4"} <= set(decode)
    assert decode["jacobi_s16_c0"]["ms_per_forward"] > 0
    assert set(res["estimate_1024"]) == {"sequential_s", "turn_ms", "forward_ms"} | {
        f"{kind}_{rate}_tokens_per_forward_s" for kind in ("jacobi", "forward_only") for rate in (2, 3, 5)}
