"""Pipeline depth x column block x split count for the decoder-form GEMV launches, each configuration
named explicitly (no autotuning), so the table shows what every candidate does, not only the pick.

Run on the GPU machine from the source tree (torch + triton only, random weights, about 30 s):

    PYTHONPATH=. python3 benchmarks/gemv_stages.py "$OUT" [--form w8a8|bf16] [--preload 0,3]

``--preload``: each configuration at each of these counts of weight tiles loaded before the PDL wait
(`stage_ar.launch_overlap.PRELOAD_TILES`; keys end in ``/preloadN`` for N > 0). (``--tma``, the
tiles by Hopper's bulk tensor copies, went with `TMA_WEIGHTS`: no faster in the H200's decode step.)

The question (issue 17, 2026-12-06): an unsplit W8A8 o or down launch is 56 programs of 64 columns;
with 3-4 stages each keeps 48-64 KB in flight, too little to keep HBM busy, so they were split into 4
K ranges (`stage_ar.gemv_configs.W8A8_SPLIT_K`), which costs the partials' round trip and a
last-arrival tail. Do deeper pipelines let the unsplit launch stream instead? For each shape in its
decoder form (`benchmarks/gemv_split_k.py`'s ``_kwargs``: qkv with bias + RoPE, o / down with the
residual, gate_up with SwiGLU; bf16: the norm launch first where the decoder has one) and each
`CONFIGS` entry: us per call at M = 1 (all weight copies' calls in one CUDA graph, copies > 4 x L2,
`benchmarks/gemv.py`), TB/s of the weight bytes, the floor at the measured copy bandwidth, and
whether the M = 16 output equals the first configuration's bit for bit (configurations of one split
count must agree: autotuning picks among them).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gemv as B  # noqa: E402 - benchmarks/gemv.py: shapes, weights, timing, compile pool
import gemv_split_k as S  # noqa: E402 - the decoder forms
from mammoth_app.make_checkpoint import preview_config  # noqa: E402
from stage_ar import gemv as G  # noqa: E402
from stage_ar import launch_overlap  # noqa: E402
from stage_ar.configuration_mammoth_ar import MammothARConfig  # noqa: E402

_W8A8_SPLITTABLE = [(bn, w, st, sp) for bn, w in ((64, 4), (128, 8), (32, 4)) for st in (3, 4, 6, 8) for sp in (1, 2, 4)]
_BF16 = [(bn, w, st, 1) for bn, w in ((16, 2), (32, 4), (64, 4)) for st in (4, 6, 8)]
#: (block_n, num_warps, num_stages, split) per shape and form.
CONFIGS = {
    "w8a8": {"o": _W8A8_SPLITTABLE, "down": _W8A8_SPLITTABLE,
             "qkv": [(bn, w, st, sp) for bn, w in ((64, 4), (32, 4)) for st in (3, 4, 6, 8) for sp in (1, 2)],
             "gate_up": [(bn, w, st, 1) for bn, w in ((64, 4), (128, 8)) for st in (3, 4, 6)]},
    "bf16": {"o": _BF16, "down": _BF16, "qkv": _BF16, "gate_up": _BF16},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--form", choices=tuple(CONFIGS), default="w8a8")
    parser.add_argument("--compile-workers", type=int, default=14)
    parser.add_argument("--preload", default="0",
                        help="comma-separated weight tiles preloaded before the PDL wait, each configuration at each "
                             "(`stage_ar.launch_overlap.PRELOAD_TILES`; keys end in /preloadN for N > 0)")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    form, table_cfg = args.form, CONFIGS[args.form]
    preloads = tuple(int(p) for p in args.preload.split(","))
    w_dtype = G.FP8_DTYPE if form == "w8a8" else torch.bfloat16
    x_dtype = G.FP8_DTYPE if form == "w8a8" else torch.bfloat16  # W8A8 launches read E4M3 codes
    table = {k: v for k, v in B.shapes(MammothARConfig.from_dict(preview_config()[0]["llm_config"])).items()
             if k in table_cfg}
    jobs = []
    for name, shape in table.items():
        flags = S.compile_flags(name, shape, form)
        for bn, w, st, sp in table_cfg[name]:
            c = G.GemvConfig(bn, w, st, None, sp)
            if G.fits_shared_memory(c, x_dtype, w_dtype):
                jobs.append((f"{name}/{c}", torch.bfloat16, w_dtype, shape["rows"], shape["K"], c, flags))
    t0 = time.time()
    res: dict = {"command": f"PYTHONPATH=. python3 benchmarks/gemv_stages.py OUT --form {form}"
                            + f" --preload {args.preload}",
                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    res["precompile"] = B.run_compile_jobs(jobs, args.compile_workers, B._compile_job)
    res["copy_bandwidth_Bps"] = bandwidth = B.copy_bandwidth()
    res["rows"] = rows = {}
    for i, (name, shape) in enumerate(table.items()):
        sets = B.make_weights(shape, B.weight_copies(shape), seed=i)
        x, residual, cos, sin = S.decoder_inputs(shape, torch.bfloat16)
        first = None
        for (bn, w, st, sp), preload in [(c, p) for c in table_cfg[name] for p in preloads]:
            c = G.GemvConfig(bn, w, st, None, sp)
            if not G.fits_shared_memory(c, x_dtype, w_dtype):
                continue
            key = f"{name}/{bn}x{w}w{st}s/split{sp}" + (f"/preload{preload}" if preload else "")
            launch_overlap.PRELOAD_TILES = preload
            try:
                weight, kw = S._kwargs(name, shape, sets[0], 16, form, residual, cos, sin)
                full = G.gemv(x, weight, config=c, **kw)
                first = full if first is None else first
                calls = []
                for ws in sets:
                    wm, kwm = S._kwargs(name, shape, ws, 1, form, residual, cos, sin)
                    calls.append(lambda wm=wm, kwm=kwm, c=c: G.gemv(x[:1], wm, config=c, **kwm))
                ms, how = B.graph_ms_per_call(calls)
                nbytes = shape["rows"] * shape["K"] * w_dtype.itemsize
                rows[key] = dict(us=ms * 1e3, TBps=nbytes / (ms / 1e3) / 1e12, floor_us=nbytes / bandwidth * 1e6,
                                 bits_equal_first=bool(torch.equal(full, first)), timing=how)
                print(f"{key:34s} {ms * 1e3:7.2f} us {rows[key]['TBps']:.2f} TB/s floor {rows[key]['floor_us']:.2f}"
                      f" same bits as the first: {rows[key]['bits_equal_first']}", flush=True)
            except Exception as exc:  # noqa: BLE001 - record and go on
                rows[key] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
                print(key, rows[key], flush=True)
        launch_overlap.PRELOAD_TILES = None
        del sets
        torch.cuda.empty_cache()
        res["elapsed_s"] = time.time() - t0
        (out / f"gemv_stages_{form}.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
