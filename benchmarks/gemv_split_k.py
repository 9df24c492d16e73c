"""Split-K for the weight-streaming GEMV (`stage_ar.gemv`): which split count per Preview AR shape.

Run on the GPU machine from the source tree (torch + triton only, random weights, 2-4 minutes):

    PYTHONPATH=. python3 benchmarks/gemv_split_k.py --out "$OUT"

The question (issue 17): at batch 1 the narrow FP8 shapes (qkv, o, down: 3,584 output columns or
fewer) stream 1.0-1.6 TB/s where bf16 streams 2.8-3.9, which looks like too few bytes in flight: 112-224
programs of 256-byte weight-row tiles on 132 SMs. Splitting K over ``split`` programs per column
block puts ``split`` times as many programs in flight; the last to finish adds the partials in split
order (`stage_ar.gemv`'s ``SPLIT_K``). What it costs: the partials' round trip (16 rows x 4 bytes
per column and split) and a tail in which one program per block finishes.

For every shape in the form the decoder launches it (qkv: bias + RoPE epilogue, o / down: residual,
gate_up: SwiGLU, head: plain; the norm as `rms_norm_rows` first), every weight form (bf16, FP8 with
float16 products, W8A8) and every split count in `SPLITS`: ms per call at M = 1 and 16 (autotuned
launch, all weight copies' calls in one CUDA graph, copies > 4 x L2, as `benchmarks/gemv.py`), TB/s
of the form's own weight bytes, whether a row alone equals the row inside M = 16 bit for bit, and the
largest difference from the unsplit launch. Per visual token: the unsplit sum and the sum with each
shape's fastest split at M = 1, against the floors.

The split count is taken from `stage_ar.gemv_configs.split_k_for` in serving; this script replaces
that rule in the `stage_ar.gemv` module for each measurement (the launch is otherwise serving's).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import traceback

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gemv as B  # noqa: E402 - benchmarks/gemv.py: shapes, weights, timing, compile pool
from mammoth_app.make_checkpoint import preview_config  # noqa: E402
from stage_ar import gemv as G  # noqa: E402
from stage_ar.configuration_mammoth_ar import MammothARConfig  # noqa: E402

#: split counts tried per shape (K tiles: 14 for the 3,584-column inputs, 74 for down's 18,944)
SPLITS = {"qkv": (1, 2, 4, 7), "o": (1, 2, 4, 7), "gate_up": (1, 2), "down": (1, 2, 4, 8), "head": (1, 2, 4)}
ALL_FORMS = ("bf16", "fp8", "w8a8")
FORMS = ALL_FORMS  # the forms measured (`--forms`)
HEAD_DIM = 128


def _kwargs(name: str, shape: dict, ws: dict, m: int, form: str, residual: torch.Tensor, cos, sin) -> tuple:
    """(weight, gemv keyword arguments) as the decoder calls ``name`` (qkv with the RoPE epilogue)."""
    w, kw = B.call_kwargs(shape, ws, m, {"bf16": "fused", "fp8": "fp8", "w8a8": "w8a8"}[form], residual)
    if name == "qkv":
        kw |= dict(cos=cos[:m], sin=sin[:m], rope_columns=(28 + 4) * HEAD_DIM)
    if name == "head":
        kw.pop("norm_weight", None)  # the final norm runs once before the head, not per launch
    return w, kw


def compile_flags(name: str, shape: dict, form: str) -> dict:
    """`stage_ar.gemv.compile_ahead`'s variant flags for ``name`` in its decoder form (``_kwargs``)."""
    flags = dict(shape["fused"])
    if name == "qkv":
        flags |= {"rope_head_dim": HEAD_DIM}
    if name == "head":
        flags.pop("norm", None)
    return flags | ({"fp8_compute": "fp8"} if form == "w8a8" else {})


def decoder_inputs(shape: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """16 rows of activations, of the residual and of the RoPE ``cos`` / ``sin`` tables for ``shape``
    in ``dtype`` (seeded: every call gets the same)."""
    g = torch.Generator(device=B.DEVICE).manual_seed(7)
    x = torch.randn(16, shape["K"], device=B.DEVICE, generator=g).to(dtype)
    residual = torch.randn(16, B.out_width(shape), device=B.DEVICE, generator=g).to(dtype)
    angles = torch.rand(16, HEAD_DIM, device=B.DEVICE, generator=g) * 6.28
    return x, residual, angles.cos().to(dtype), angles.sin().to(dtype)


def _rule(split: int):
    return lambda n, k, weight_dtype, fp8_compute=None: split


def compile_jobs(table: dict) -> list[tuple]:
    """Every (shape, form, split, candidate) autotuning will compile, as `stage_ar.gemv.compile_ahead` jobs."""
    jobs = []
    for name, shape in table.items():
        for form in FORMS:
            w_dtype = torch.bfloat16 if form == "bf16" else G.FP8_DTYPE
            f = compile_flags(name, shape, form)
            for split in SPLITS[name]:
                for c in G.tuned_configs(w_dtype, f.get("fp8_compute")):
                    c = G.GemvConfig(c.block_n, c.num_warps, c.num_stages, None, split)
                    if G.fits_shared_memory(c, torch.bfloat16, w_dtype):
                        jobs.append((f"{name}/{form}/{c}", torch.bfloat16, w_dtype, shape["rows"], shape["K"], c, f))
    return jobs


def measure(name: str, shape: dict, sets: list[dict], form: str, split: int) -> dict:
    """Timings at M = 1 and 16 and the bit checks for one (shape, form, split)."""
    G.split_k_for = _rule(split)
    x, residual, cos, sin = decoder_inputs(shape, sets[0]["w"].dtype)
    rec: dict = {}
    w, kw = _kwargs(name, shape, sets[0], 16, form, residual, cos, sin)
    full = G.gemv(x, w, **kw)
    rec["tuned"] = str(G.last_tuned_config())
    alone = [torch.equal(G.gemv(x[i : i + 1], w, **_rows(kw, i))[0], full[i]) for i in (0, 9, 15)]
    rec["row_alone_equals_row_in_16"] = all(alone)
    # every candidate autotuning may pick, at this split: the same bits as the tuned launch?
    same = {}
    for c in G.tuned_configs(w.dtype, kw.get("fp8_compute")):
        c = G.GemvConfig(c.block_n, c.num_warps, c.num_stages, None, split)
        if G.fits_shared_memory(c, torch.bfloat16, w.dtype):
            same[str(c)] = bool(torch.equal(G.gemv(x, w, config=c, **kw), full))
    rec["candidates_same_bits"] = same
    rec["out"] = full
    weight_bytes = shape["rows"] * shape["K"] * (2 if form == "bf16" else 1)
    for m in (1, 16):
        calls = []
        for ws in sets:
            wm, kwm = _kwargs(name, shape, ws, m, form, residual, cos, sin)
            calls.append(lambda wm=wm, kwm=kwm: G.gemv(x[:m], wm, **kwm))
        ms, how = B.graph_ms_per_call(calls)
        rec[f"M{m}"] = dict(ms=ms, TBps=weight_bytes / (ms / 1e3) / 1e12, timing=how)
    return rec


def _rows(kw: dict, i: int) -> dict:
    return kw | {key: kw[key][i : i + 1] for key in ("residual", "cos", "sin") if key in kw}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=400.0, help="start no new measurement after this")
    parser.add_argument("--compile-workers", type=int, default=min(14, max(1, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--shapes", default=",".join(SPLITS), help="comma-separated subset of the shapes")
    parser.add_argument("--forms", default=",".join(ALL_FORMS), help="comma-separated subset of the weight forms")
    args = parser.parse_args()
    global FORMS
    FORMS = tuple(f for f in ALL_FORMS if f in args.forms.split(","))
    t0 = time.time()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    table = {k: v for k, v in B.shapes(MammothARConfig.from_dict(preview_config()[0]["llm_config"])).items()
             if k in args.shapes.split(",")}
    res: dict = {"command": "PYTHONPATH=. python3 benchmarks/gemv_split_k.py --out $OUT",
                 "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "splits": SPLITS}

    def save(what: str) -> None:
        res["elapsed_s"] = time.time() - t0
        (out / "gemv_split_k.json").write_text(json.dumps(res, indent=2, default=str))
        print(f"-- {what} at {res['elapsed_s']:.0f}s", flush=True)

    if args.compile_workers:
        res["precompile"] = B.run_compile_jobs(compile_jobs(table), args.compile_workers, B._compile_job)
        print("precompile", json.dumps(res["precompile"])[:400], flush=True)
    res["copy_bandwidth_Bps"] = bandwidth = B.copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    save("ceiling")
    res["results"] = results = {}
    rule = G.split_k_for
    for i, (name, shape) in enumerate(table.items()):
        sets = B.make_weights(shape, B.weight_copies(shape), seed=i)
        for form in FORMS:
            base = None
            for split in SPLITS[name]:
                key = f"{name}/{form}/split{split}"
                if time.time() - t0 > args.budget_s:
                    results[key] = "skipped: time budget"
                    continue
                try:
                    rec = measure(name, shape, sets, form, split)
                    got = rec.pop("out").float()
                    base = got if split == 1 else base
                    if base is not None:
                        rec["max_abs_diff_vs_split1"] = float((got - base).abs().max())
                        rec["bits_equal_split1"] = bool(torch.equal(got, base))
                    results[key] = rec
                    print(f"{key:22s} M1 {rec['M1']['ms'] * 1e3:7.1f}us {rec['M1']['TBps']:.2f}TB/s  "
                          f"M16 {rec['M16']['ms'] * 1e3:7.1f}us {rec['M16']['TBps']:.2f}TB/s  "
                          f"invariant {rec['row_alone_equals_row_in_16']} tuned {rec['tuned']} "
                          f"diff {rec.get('max_abs_diff_vs_split1', 0):.3g}", flush=True)
                except Exception as exc:  # noqa: BLE001 - record and go on
                    results[key] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                    traceback.print_exc()
            G.split_k_for = rule
            save(f"{name}/{form}")
        del sets
        torch.cuda.empty_cache()
    res["per_token"] = per_token(results, table, bandwidth)
    print(json.dumps(res["per_token"], indent=1), flush=True)
    save("done")


def per_token(results: dict, table: dict, bandwidth: float) -> dict:
    """Per visual token (ms): each form unsplit and with each shape's fastest split at M = 1 (that
    split's M = 16 time too), against the bf16 / FP8 weight floors."""
    bytes16 = sum(s["rows"] * s["K"] * 2 * s["per_token"] for s in table.values())
    out: dict = {"floor_bf16_ms": bytes16 / bandwidth * 1e3, "floor_fp8_ms": bytes16 / 2 / bandwidth * 1e3}
    for form in FORMS:
        unsplit = {"M1": 0.0, "M16": 0.0}
        best = {"M1": 0.0, "M16": 0.0, "splits": {}}
        try:
            for name, shape in table.items():
                recs = {s: results[f"{name}/{form}/split{s}"] for s in SPLITS[name]}
                recs = {s: r for s, r in recs.items() if isinstance(r, dict)}
                pick = min(recs, key=lambda s: recs[s]["M1"]["ms"])
                best["splits"][name] = pick
                for m in ("M1", "M16"):
                    unsplit[m] += recs[1][m]["ms"] * shape["per_token"]
                    best[m] += recs[pick][m]["ms"] * shape["per_token"]
        except (KeyError, ValueError) as exc:
            out[form] = f"incomplete: {exc!r}"
            continue
        out[form] = {"unsplit": unsplit, "best_split": best}
    return out


if __name__ == "__main__":
    main()
