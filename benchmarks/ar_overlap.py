"""Batch-1 decode with each launch-overlap mode (`stage_ar.launch_overlap`): one process per mode,
since the mode is read at import. bf16 at image start and mid-image, then the visual-token weights
converted to FP8 and W8A8 at image start; every variant profiled (`torch.profiler` over 5 graph
replays). The mode's kernels are checked to carry what it asks for (PTX).

    PYTHONPATH=. python3 benchmarks/ar_overlap.py "$OUT/overlap" off,pdl

Writes ``<prefix>_<mode>.json`` per mode and prints ms/step per variant. About 90 s per mode on the H200.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def one_mode(out: str) -> None:
    tree = os.getcwd()
    sys.path[:0] = [os.path.join(tree, "benchmarks"), tree]
    import ar_decode as A
    import torch

    from stage_ar import gemv, launch_overlap

    t0 = time.time()
    res = {"mode": launch_overlap.MODE, "ceilings": A.ceilings(), "tree": tree}
    ptx = gemv.compile_ahead(torch.bfloat16, torch.bfloat16, 4608, 3584, gemv.GemvConfig(16, 4, 3), bias=True,
                             rope_head_dim=128).asm["ptx"]
    res["ptx_has"] = {s: s in ptx for s in ("griddepcontrol.wait", "griddepcontrol.launch_dependents")}
    print(res["mode"], res["ceilings"], res["ptx_has"], flush=True)
    config, _ = A.preview_config()
    model, _ = A.random_preview_modules(config, dit=False)
    model.eval().requires_grad_(False)
    A.set_linear_backend(model, A.select_backend("auto", "cuda"))

    def save() -> None:
        res["elapsed_s"] = time.time() - t0
        with open(out, "w") as f:
            f.write(json.dumps(res, indent=2, default=str))

    A.time_variant(model, res, "bf16", {}, (1,), 100, mid_image=True, profile=True, save=save)
    A.quantize_fp8_(model.visual_token_linears())
    torch.cuda.empty_cache()
    A.set_linear_backend(model, A.GemvLinear(fp8_compute="fp8"))
    A.time_variant(model, res, "w8a8", {}, (1,), 100, profile=True, save=save)
    save()


def main(prefix: str, modes: list[str]) -> None:
    summary = {}
    for mode in modes:
        out = f"{prefix}_{mode}.json"
        env = dict(os.environ, MAMMOTH_AR_LAUNCH_OVERLAP=mode)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--one", out], env=env, check=True)
        with open(out) as f:
            t = json.load(f).get("timings", {})
        summary[mode] = {k: round(v["ms_per_step"], 4) for k, v in t.items() if isinstance(v, dict) and "ms_per_step" in v}
        print(mode, summary[mode], flush=True)
    print(json.dumps(summary, indent=2), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        one_mode(sys.argv[2])
    else:
        main(sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "off,pdl").split(","))
