"""Sections of `benchmarks/ar_decode.py` for the source tree in the working directory, profiled, so a
tree checked out elsewhere can be timed by this same script in the same device call (older trees'
`ar_decode.py` lacks these switches).

    PYTHONPATH=. python3 benchmarks/ar_tree.py "$OUT/new.json" bf16,fp8                  # this tree
    (cd ../old && PYTHONPATH=. python3 /path/to/benchmarks/ar_tree.py "$OUT/old.json" bf16)  # another tree

Sections: ``bf16``: batch 1 with the default runner (`compiled`, at image start and mid-image) and
the served engine's padded shape (`compiled_served_shape`: 16 slots of the served pool width, 8
sequences; the GEMV tuned again first, at that shape's M, as the served process tunes it); ``fp8``:
`ar_decode.fp8_timings` (W8A16 and W8A8, batch 1 and 8, deviation from bf16; the model stays FP8
after it, so it runs last); ``w8a8``: instead of ``fp8``, only W8A8 at batch 1
(weights converted, no deviation). The tree's launch-overlap mode (`stage_ar.launch_overlap`, where
it has one) is recorded. Every timed batch-1 variant gets a `torch.profiler`
table. Writes the JSON and prints ms/step per variant. About 60 s (bf16) and 150 s (fp8) on the H200.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(out: str, sections: list[str]) -> None:
    tree = os.getcwd()
    sys.path[:0] = [os.path.join(tree, "benchmarks"), tree]  # the tree under test, not this file's
    import ar_decode as A

    timed = A.time_variant

    def profiled(model, res, label, opts, batches, steps, **kw):
        return timed(model, res, label, opts, batches, steps, **(kw | {"profile": True}))

    A.time_variant = profiled
    t0 = time.time()
    res = {"ceilings": A.ceilings(), "tree": tree, "command": "benchmarks/ar_tree.py", "sections": sections}
    try:
        from stage_ar import launch_overlap

        res["launch_overlap"] = launch_overlap.MODE
    except ImportError:  # a tree from before it
        res["launch_overlap"] = None
    print("ceilings", res["ceilings"], flush=True)
    config, _ = A.preview_config()
    model, _ = A.random_preview_modules(config, dit=False)
    model.eval().requires_grad_(False)
    A.set_linear_backend(model, A.select_backend("auto", "cuda"))

    def save() -> None:
        res["elapsed_s"] = time.time() - t0
        with open(out, "w") as f:
            f.write(json.dumps(res, indent=2, default=str))

    if "bf16" in sections:
        A.time_variant(model, res, "compiled", {}, (1,), 100, mid_image=True, save=save)
        if hasattr(A, "retune_gemv"):  # older trees' ar_decode.py lacks it
            A.retune_gemv()
        A.time_variant(model, res, "compiled_served_shape", {"pad_to_max_bucket": True}, (1,), 100, slots=16,
                       capacity=min(A.DEFAULTS.max_sequence_length, model.config.max_position_embeddings),
                       mid_image=True, save=save)
    if "fp8" in sections:
        A.fp8_timings(model, res, 100, save, w8a8=True)
    elif "w8a8" in sections:
        A.quantize_fp8_(model.visual_token_linears())
        A.set_linear_backend(model, A.GemvLinear(fp8_compute="fp8"))
        A.time_variant(model, res, "fp8_w8a8", {}, (1,), 100, save=save)
    save()
    for key, v in res.get("timings", {}).items():
        if isinstance(v, dict) and "ms_per_step" in v:
            print(key, round(v["ms_per_step"], 4), round(v.get("tokens_per_s", 0.0), 1), flush=True)
    print("elapsed_s", res["elapsed_s"], flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ar_tree.json",
         (sys.argv[2] if len(sys.argv) > 2 else "bf16,fp8").split(","))
