"""`benchmarks/dit_batching.py --tiny` runs on the CPU, side by side (this tree as the "old" one, in the old
servicer's thread-per-request mode), and writes the JSON the lead reads on the GPU."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_tiny_benchmark_writes_side_by_side_json(tmp_path):
    out = tmp_path / "dit_batching.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dit_batching.py"), "--tiny", "--old-tree", str(ROOT),
                    "--old-mode", "threads", "--repeat", "1", "--concurrency", "1,2", "--out", str(out)],
                   check=True, timeout=600, cwd=str(tmp_path))
    result = json.loads(out.read_text())
    assert result["old"]["mode"] == "threads" and result["new"]["mode"] == "engine"
    for side in ("old", "new"):
        for size in ("32", "64"):
            entry = result[side]["sizes"][size]
            assert entry["ms_per_step"] > 0
            assert set(entry["concurrency"]) == {"1", "2"}
            for level in entry["concurrency"].values():
                assert level["images_per_min"] > 0 and 0 < level["p50_s"] <= level["p99_s"]
    assert set(result["speedup"]["64"]) == {"ms_per_step", "images_per_min_c1", "images_per_min_c2"}
