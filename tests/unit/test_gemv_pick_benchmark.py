"""`benchmarks/gemv_pick.py` end to end on the CPU: the served engine built as ``mammoth ar`` builds it
(the tiny checkpoint), its warm-up run, the picks file written (none to pick without CUDA: the
interpreter never autotunes) and one request decoded in-process through that engine. The GPU run
picks the real variants (docs/PERFORMANCE.md, issue 17's eighteenth session)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_gemv_pick_writes_a_picks_file_and_times_a_request_in_process(tmp_path, tiny_checkpoint):
    out = tmp_path / "picks.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gemv_pick.py"), str(out), "--checkpoint", str(tiny_checkpoint),
         "--device", "cpu", "--rounds", "2", "--time-grid", "4"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["version"] == 1 and res["device"] == "cpu"
    assert res["picks"] == {} and res["unstable"] == {} and len(res["rounds"]) == 2
    request = res["inprocess_request"]
    assert request["generated_tokens"] == 4 * 5  # a 4 x 4 grid: four rows of four tokens and an end of line
    assert request["prompt_tokens"] > 0 and request["decode_ms"] > 0
    assert request["ms_per_token"] == request["decode_ms"] / request["generated_tokens"]
