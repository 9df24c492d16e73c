"""Decode with each launch-overlap mode (`stage_ar.launch_overlap`) side by side: one
`benchmarks/ar_tree.py` process per mode (the mode is read at import), sections ``bf16`` (batch 1 at
image start and mid-image, the served shape; profiled) and ``w8a8`` (FP8 weights, W8A8, batch 1).

    PYTHONPATH=. python3 benchmarks/ar_overlap.py "$OUT/overlap" off,pdl

Writes ``<prefix>_<mode>.json`` per mode and prints ms/step per variant. About 90 s per mode on the H200.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def main(prefix: str, modes: list[str]) -> None:
    tree_script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ar_tree.py")
    summary = {}
    for mode in modes:
        out = f"{prefix}_{mode}.json"
        env = dict(os.environ, MAMMOTH_AR_LAUNCH_OVERLAP=mode)
        subprocess.run([sys.executable, tree_script, out, "bf16,w8a8"], env=env, check=True)
        with open(out) as f:
            t = json.load(f).get("timings", {})
        summary[mode] = {k: round(v["ms_per_step"], 4) for k, v in t.items() if isinstance(v, dict) and "ms_per_step" in v}
        print(mode, summary[mode], flush=True)
    print(json.dumps(summary, indent=2), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "off,pdl").split(","))
