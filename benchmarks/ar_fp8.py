"""Section 6 of `benchmarks/ar_decode.py` alone (FP8 weights: W8A16 and W8A8, batch 1 and 8, profiled),
for the source tree in the working directory, so a tree checked out elsewhere can be timed by this
same script in the same device call (older trees' `ar_decode.py` has no FP8-only switch).

    PYTHONPATH=. python3 benchmarks/ar_fp8.py "$OUT/fp8_new.json"                 # this tree
    (cd ../old && PYTHONPATH=. python3 /path/to/benchmarks/ar_fp8.py "$OUT/fp8_old.json")  # another tree

Writes the JSON of `ar_decode.fp8_timings` (timings, a `torch.profiler` table per timed batch-1
variant, FP8 floor, deviation from bf16) and prints ms/step per variant. About 150 s on the H200.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(out: str) -> None:
    tree = os.getcwd()
    sys.path[:0] = [os.path.join(tree, "benchmarks"), tree]  # the tree under test, not this file's
    import ar_decode as A

    timed = A.time_variant

    def profiled(model, res, label, opts, batches, steps, **kw):
        return timed(model, res, label, opts, batches, steps, **(kw | {"profile": True}))

    A.time_variant = profiled
    t0 = time.time()
    res = {"ceilings": A.ceilings(), "tree": tree, "command": "benchmarks/ar_fp8.py"}
    print("ceilings", res["ceilings"], flush=True)
    config, _ = A.preview_config()
    model, _ = A.random_preview_modules(config, dit=False)
    model.eval().requires_grad_(False)
    A.set_linear_backend(model, A.select_backend("auto", "cuda"))

    def save() -> None:
        res["elapsed_s"] = time.time() - t0
        with open(out, "w") as f:
            f.write(json.dumps(res, indent=2, default=str))

    A.fp8_timings(model, res, 100, save, w8a8=True)
    save()
    for key, v in res.get("timings", {}).items():
        if isinstance(v, dict) and "ms_per_step" in v:
            print(key, round(v["ms_per_step"], 4), round(v.get("tokens_per_s", 0.0), 1), flush=True)
    print("floor_fp8_ms", res.get("floor_fp8", {}).get("ms_per_token"), "elapsed_s", res["elapsed_s"], flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ar_fp8.json")
