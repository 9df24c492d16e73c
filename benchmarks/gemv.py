"""Weight-streaming GEMV kernels (`stage_ar.gemv`) on a GPU at the MammothModa2-Preview AR shapes.

Run on the GPU machine from the source tree (torch + triton only, random weights, about 3 minutes
with autotuning):

    PYTHONPATH=. python3 benchmarks/gemv.py --out "$OUT"

Sections (each printed as it finishes; ``gemv.json`` in --out is rewritten after every one, so a
crash or the time budget keeps what finished; a failing variant records its error and the rest go on;
run order: precompile, 1, 0, timings at M = 1 and 16, 2, the other timings, 4, 5):
0. variants side by side (`benchmarks/gemv_variants.py`, first, within ``--variants-budget-s``): one
   plain linear per shape at M = 1 and 16 by cuBLAS bf16, our GEMV bf16, our FP8 GEMV (bf16 or
   float16 widening, 256- or 512-column K tiles; W8A8), the torch dequantise-then-cuBLAS FP8 path and
   ``torch._scaled_mm`` (FP8 x FP8); per visual token against the bf16 and FP8 floors;
1. ceiling: device-to-device copy bandwidth of a 2 GiB buffer (bytes read + written);
2. correctness at every shape in its fused form (the way a decoder layer uses it) and plain, bf16
   and FP8 weights (and W8A8, fused): vs `stage_ar.gemv_reference` at M = 1 and 16 (max abs error, and how many
   outputs differ by more than one bf16 ulp); batch invariance (rows alone, as M = 5 and inside
   M = 16, bit for bit); every autotuning candidate bit for bit equal to the tuned one;
3. timings, M in {1, 2, 4, 8, 16}: cuBLAS bf16 (``F.linear``), ours plain bf16, ours fused bf16,
   ours fused FP8: each call on its own copy of the weights (copies > 4 x L2, so nothing is served
   from cache, as in a real forward), all copies' calls in one CUDA graph, replayed; ms per call and
   TB/s of weight bytes (FP8: its own bytes);
4. per visual token: 28 layers x (qkv + o + gate_up + down) + the head rows a grid step samples,
   for each path, against the HBM floor (the bf16 / FP8 weight bytes at the measured copy bandwidth);
5. exploration (if time is left), o and gate_up, bf16 and FP8: other K tile widths (bf16 only;
   their bits may differ: the K tile is fixed in serving for that reason) and wider column blocks
   (Triton's wgmma path), each one's speed and whether its bits equal the tuned launch's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time
import traceback

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mammoth_app.make_checkpoint import preview_config  # noqa: E402
from stage_ar import gemv as G  # noqa: E402
from stage_ar.configuration_mammoth_ar import MammothARConfig  # noqa: E402
from stage_ar.fp8 import quantize_fp8_per_channel  # noqa: E402
from stage_ar.gemv_reference import gemv_reference  # noqa: E402

MS = (1, 2, 4, 8, 16)
BF16_ULP = 2.0**-7  # relative spacing of bf16 at 1 (8 significant bits)
#: "cuda", or "cpu" for ``--smoke`` (tiny shapes under TRITON_INTERPRET=1: checks this script's logic)
DEVICE = "cuda"
#: Rows of ``gen_head`` from EOL (152064, row 0) to the last visual code (152072 + 16383): MODEL.md
VISUAL_HEAD_ROWS = 8 + 16384


def shapes(cfg: MammothARConfig) -> dict[str, dict]:
    """name -> K, weight rows, the fused form's flags, calls per visual token (from the config;
    the generation experts of layers 14..27 have the base projections' shapes)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    layers = cfg.num_hidden_layers
    return {
        "qkv": dict(K=h, rows=qkv, fused=dict(norm=True, bias=True), per_token=layers),
        "o": dict(K=h, rows=h, fused=dict(residual=True), per_token=layers),
        "gate_up": dict(K=h, rows=2 * i, fused=dict(norm=True, swiglu=True), per_token=layers),
        "down": dict(K=i, rows=h, fused=dict(residual=True), per_token=layers),
        # the gen head's rows a grid step can sample: EOL (row 0) through the last visual code
        "head": dict(K=h, rows=VISUAL_HEAD_ROWS, fused=dict(norm=True), per_token=1),
    }


def smoke_shapes() -> dict[str, dict]:
    """The same table at toy sizes (partial K tiles, partial column blocks) for ``--smoke``."""
    return {
        "qkv": dict(K=272, rows=80, fused=dict(norm=True, bias=True), per_token=2),
        "o": dict(K=272, rows=272, fused=dict(residual=True), per_token=2),
        "gate_up": dict(K=272, rows=400, fused=dict(norm=True, swiglu=True), per_token=2),
        "down": dict(K=200, rows=272, fused=dict(residual=True), per_token=2),
        "head": dict(K=272, rows=40, fused=dict(norm=True), per_token=1),
    }


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (median of 10)."""
    size = 2 * 1024**3 if DEVICE == "cuda" else 64 * 1024**2
    a = torch.empty(size, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    ms = sorted(_event_ms(lambda: b.copy_(a)) for _ in range(10))[5]
    del a, b
    return 2 * size / (ms / 1e3)


def _event_ms(fn) -> float:
    """Milliseconds of ``fn()`` (CUDA events; wall clock on the CPU)."""
    if DEVICE != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def weight_copies(shape: dict, weight_bytes: int = 2) -> int:
    """How many weight copies of ``shape`` a timing cycles through so the weights it streams exceed
    4 x the device's L2 (nothing served from cache, as in a real forward): at least 2.
    ``weight_bytes``: bytes per weight element of the form timed (2: bf16, 1: FP8)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if DEVICE == "cuda" else 2**16
    return max(2, math.ceil(4 * l2 / (shape["rows"] * shape["K"] * weight_bytes)))


def make_weights(shape: dict, copies: int, seed: int) -> list[dict]:
    """``copies`` independent weight sets (bf16 weight, its FP8 form, bias, norm weight)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    sets = []
    for _ in range(copies):
        w = torch.randn(shape["rows"], shape["K"], device=DEVICE, generator=g) / shape["K"] ** 0.5
        w = w.to(torch.bfloat16 if DEVICE == "cuda" else torch.float16)
        w8, scale = quantize_fp8_per_channel(w)
        sets.append(dict(
            w=w, w8=w8, scale=scale,
            bias=(0.1 * torch.randn(shape["rows"], device=DEVICE, generator=g)).to(w.dtype),
            norm=(1.0 + 0.1 * torch.randn(shape["K"], device=DEVICE, generator=g)).to(w.dtype),
        ))
    return sets


def call_kwargs(shape: dict, ws: dict, m: int, form: str, residual: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """(weight, gemv keyword arguments) of one form: ``plain``, ``fused`` (bf16), ``fp8`` (fused) or
    ``w8a8`` (fused FP8, ``fp8_compute="fp8"``)."""
    if form == "plain":
        return ws["w"], {}
    flags = shape["fused"]
    kw = {}
    if flags.get("norm"):
        kw["norm_weight"] = ws["norm"]
    if flags.get("bias"):
        kw["bias"] = ws["bias"]
    if flags.get("residual"):
        kw["residual"] = residual[:m]
    if flags.get("swiglu"):
        kw["swiglu"] = True
    if form in ("fp8", "w8a8"):
        return ws["w8"], kw | {"weight_scale": ws["scale"]} | ({"fp8_compute": "fp8"} if form == "w8a8" else {})
    return ws["w"], kw


def out_width(shape: dict) -> int:
    return shape["rows"] // 2 if shape["fused"].get("swiglu") else shape["rows"]


def check_form(name: str, shape: dict, ws: dict, form: str, x: torch.Tensor, residual: torch.Tensor) -> dict:
    """Accuracy vs the reference, batch invariance, and every candidate config's bits, for one form."""
    rec = {}
    for m in (1, 16):
        w, kw = call_kwargs(shape, ws, m, form, residual)
        t = time.time()
        got = G.gemv(x[:m], w, **kw).float()
        rec[f"first_call_M{m}_s"] = time.time() - t  # autotuning (and compiling, unless precompiled)
        want = gemv_reference(x[:m], w, **kw).float()
        diff = (got - want).abs()
        rec[f"M{m}"] = dict(
            max_abs_err=float(diff.max()), max_abs_ref=float(want.abs().max()),
            over_1ulp=int((diff > BF16_ULP * want.abs().clamp_min(2.0**-20)).sum()), outputs=diff.numel(),
            close=bool(torch.allclose(got, want, atol=2e-2, rtol=2e-2)),
        )
        if form in ("fp8", "w8a8"):  # what quantising the weights (and activations) costs: vs the same call with the bf16 weights
            w16, kw16 = call_kwargs(shape, ws, m, "fused", residual)
            bf16 = gemv_reference(x[:m], w16, **kw16).float()
            rec[f"M{m}"]["rel_err_vs_bf16_weights"] = float((got - bf16).norm() / bf16.norm())
    w, kw = call_kwargs(shape, ws, 16, form, residual)
    full = G.gemv(x, w, **kw)
    rec["tuned_M16"] = str(G.last_tuned_config())
    alone = all(torch.equal(G.gemv(x[i : i + 1], w, **_rows(kw, i, i + 1))[0], full[i]) for i in (0, 5, 15))
    five = torch.equal(G.gemv(x[3:8], w, **_rows(kw, 3, 8)), full[3:8])
    rec["batch_invariant"] = bool(alone and five)
    per_config = {}
    for c in G.tuned_configs(w.dtype, kw.get("fp8_compute")):
        if not G.fits_shared_memory(c, x.dtype, w.dtype):
            continue  # autotuning prunes it too
        try:
            per_config[str(c)] = bool(torch.equal(G.gemv(x, w, config=c, **kw), full))
        except Exception as exc:  # noqa: BLE001 - a candidate that does not compile is recorded
            per_config[str(c)] = f"error: {type(exc).__name__}: {str(exc)[:120]}"
    rec["configs_bit_identical"] = per_config
    rec["all_configs_bit_identical"] = all(v is True for v in per_config.values())
    print(f"check {name:9s} {form:6s}", json.dumps(rec["M16"]), "invariant", rec["batch_invariant"],
          "configs equal", rec["all_configs_bit_identical"], flush=True)
    return rec


def _rows(kw: dict, lo: int, hi: int) -> dict:
    return kw | ({"residual": kw["residual"][lo:hi]} if "residual" in kw else {})


def graph_ms_per_call(calls: list, replays: int = 20) -> tuple[float, str]:
    """Mean ms per call of ``calls`` captured into one CUDA graph (eager launches if capture fails)."""
    for fn in calls:  # warm-up outside capture: autotuning, compilation
        fn()
    _sync()
    if DEVICE != "cuda":
        return _event_ms(lambda: [fn() for fn in calls]) / len(calls), "eager"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        graph.replay()
        torch.cuda.synchronize()
        ms = sorted(_event_ms(lambda: [graph.replay() for _ in range(replays)]) for _ in range(3))[1]
        return ms / replays / len(calls), "cuda_graph"
    except Exception:  # noqa: BLE001 - capture is not essential to the number
        ms = sorted(_event_ms(lambda: [fn() for _ in range(replays) for fn in calls]) for _ in range(3))[1]
        return ms / replays / len(calls), "eager"


def time_shape(name: str, shape: dict, sets: list[dict], ms_list: tuple, deadline: float) -> dict:
    """Timings of every path at each M of ``ms_list`` for one shape."""
    k, rows, n = shape["K"], shape["rows"], out_width(shape)
    dtype = sets[0]["w"].dtype
    x = torch.randn(16, k, device=DEVICE).to(dtype)
    residual = torch.randn(16, n, device=DEVICE).to(dtype)
    out = {}
    for m in ms_list:
        row = {}
        paths = {
            "cublas_bf16": lambda ws: (lambda: F.linear(x[:m], ws["w"])),
            "ours_bf16": _ours(shape, m, "plain", x, residual),
            "ours_fused_bf16": _ours(shape, m, "fused", x, residual),
            "ours_fused_fp8": _ours(shape, m, "fp8", x, residual),
        }
        if shape["fused"].get("norm"):  # the alternative: every GEMV program normalises its tiles
            paths["ours_fused_bf16_norm_prologue"] = _ours(shape, m, "fused", x, residual, norm_in_prologue=True)
        for path, make in paths.items():
            if time.time() > deadline:
                row[path] = "skipped: time budget"
                continue
            try:
                ms, how = graph_ms_per_call([make(ws) for ws in sets])
                weight_bytes = rows * k * (1 if path.endswith("fp8") else 2)
                row[path] = dict(ms=ms, TBps=weight_bytes / (ms / 1e3) / 1e12, timing=how)
            except Exception as exc:  # noqa: BLE001 - one failing path must not end the run
                row[path] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc()
        out[f"M{m}"] = row
        print(f"time  {name:9s} M={m:2d}", "  ".join(
            f"{p}={v['ms'] * 1e3:7.1f}us/{v['TBps']:.2f}TB/s" if isinstance(v, dict) else f"{p}={v}"
            for p, v in row.items()), flush=True)
    return out


def _ours(shape: dict, m: int, form: str, x: torch.Tensor, residual: torch.Tensor, **extra):
    def make(ws):
        w, kw = call_kwargs(shape, ws, m, form, residual)
        return lambda: G.gemv(x[:m], w, **kw, **extra)
    return make


def per_token(timings: dict, table: dict, bandwidth: float) -> dict:
    """Sum over one visual token's calls, per path and M, with the HBM floors."""
    bytes16 = sum(s["rows"] * s["K"] * 2 * s["per_token"] for s in table.values())
    out = {"floor_bf16_ms": bytes16 / bandwidth * 1e3, "floor_fp8_ms": bytes16 / 2 / bandwidth * 1e3,
           "weight_GB_bf16": bytes16 / 1e9}
    for m in MS:
        sums = {}
        for path in ("cublas_bf16", "ours_bf16", "ours_fused_bf16", "ours_fused_fp8", "ours_fused_bf16_norm_prologue"):
            try:  # the prologue path exists only where the fused form has a norm: the fused one elsewhere
                sums[path] = sum(timings[n][f"M{m}"].get(path, timings[n][f"M{m}"]["ours_fused_bf16"])["ms"]
                                 * s["per_token"] for n, s in table.items())
            except (KeyError, TypeError):
                sums[path] = None
        out[f"M{m}"] = sums
    return out


#: Launches outside the tuned set: other K tiles (change a row's bits by design) and wider column
#: blocks (Triton's wgmma path: do they keep the bits of the tuned mma.sync path?).
EXPLORE = (G.GemvConfig(0, 0, 0, 128), G.GemvConfig(0, 0, 0, 512),
           G.GemvConfig(64, 4, 3), G.GemvConfig(64, 8, 4), G.GemvConfig(128, 8, 3))


EXPLORE_FORMS = (("o", "plain"), ("gate_up", "plain"), ("o", "fp8"), ("gate_up", "fp8"))


def explore(table: dict, sets: dict, deadline: float) -> dict:
    """Speed of `EXPLORE`'s launches (K tiles: plain forms only) and whether their bits equal the tuned one's."""
    out = {}
    for name, form in EXPLORE_FORMS:
        shape, ws = table[name], sets[name]
        x = torch.randn(16, shape["K"], device=DEVICE).to(ws[0]["w"].dtype)
        residual = torch.randn(16, out_width(shape), device=DEVICE).to(x.dtype)
        weight_bytes = shape["rows"] * shape["K"] * (1 if form == "fp8" else 2)
        for m in (1, 16):
            w0, kw0 = call_kwargs(shape, ws[0], m, form, residual)
            base = G.gemv(x[:m], w0, **kw0)
            tuned = G.last_tuned_config() or (G.INTERPRETER_CONFIG if DEVICE != "cuda" else None)
            for e in EXPLORE:
                if time.time() > deadline or tuned is None or (e.block_k and form != "plain"):
                    continue
                c = G.GemvConfig(e.block_n or tuned.block_n, e.num_warps or tuned.num_warps,
                                 e.num_stages or tuned.num_stages, e.block_k)
                key = f"{name}/{form}/M{m}/{c}"
                try:
                    same = torch.equal(G.gemv(x[:m], w0, config=c, **kw0), base)
                    calls = [_explore_call(shape, w_, m, form, residual, x, c) for w_ in ws]
                    ms, _ = graph_ms_per_call(calls)
                    out[key] = dict(ms=ms, TBps=weight_bytes / ms / 1e9, bits_equal_to_tuned=same, tuned=str(tuned))
                except Exception as exc:  # noqa: BLE001
                    out[key] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
                print("explore", key, out[key], flush=True)
    return out


def _explore_call(shape: dict, ws: dict, m: int, form: str, residual: torch.Tensor, x: torch.Tensor, c):
    w, kw = call_kwargs(shape, ws, m, form, residual)
    return lambda: G.gemv(x[:m], w, config=c, **kw)


def precompile_jobs(table: dict) -> list[tuple]:
    """Every (shape, form, candidate config) autotuning will compile, as `stage_ar.gemv.compile_ahead` arguments."""
    jobs = []
    for name, shape in table.items():
        for mode in ("float16", "fp8"):  # section 0's float16-compute and W8A8 FP8 launches (plain)
            for c in G.tuned_configs(G.FP8_DTYPE, mode):
                if G.fits_shared_memory(c, torch.bfloat16, G.FP8_DTYPE):
                    jobs.append((f"{name}/fp8-{mode}/{c}", torch.bfloat16, G.FP8_DTYPE, shape["rows"], shape["K"], c,
                                 {"fp8_compute": mode}))
        for form in ("plain", "fused", "fp8", "w8a8"):
            flags = {} if form == "plain" else dict(shape["fused"]) | ({"fp8_compute": "fp8"} if form == "w8a8" else {})
            w_dtype = G.FP8_DTYPE if form in ("fp8", "w8a8") else torch.bfloat16
            for c in G.tuned_configs(w_dtype, flags.get("fp8_compute")):
                if G.fits_shared_memory(c, torch.bfloat16, w_dtype):
                    jobs.append((f"{name}/{form}/{c}", torch.bfloat16, w_dtype, shape["rows"], shape["K"], c, flags))
                    if form == "fused" and flags.get("norm"):
                        jobs.append((f"{name}/{form}-prologue/{c}", torch.bfloat16, w_dtype, shape["rows"],
                                     shape["K"], c, flags | {"norm_in_prologue": True}))
        for ename, form in EXPLORE_FORMS:
            if ename == name:
                flags = {} if form == "plain" else dict(shape["fused"])
                w_dtype = G.FP8_DTYPE if form == "fp8" else torch.bfloat16
                jobs += [(f"{name}/explore/{form}/{c}", torch.bfloat16, w_dtype, shape["rows"], shape["K"], c, flags)
                         for c in EXPLORE if c.block_n]
    return jobs


def _compile_job(job: tuple) -> tuple[str, float, str | None]:
    key, x_dtype, w_dtype, rows, k, config, flags = job
    t = time.time()
    try:
        G.compile_ahead(x_dtype, w_dtype, rows, k, config, **flags)
        return key, time.time() - t, None
    except Exception as exc:  # noqa: BLE001 - autotuning will compile (or fail) it again in-process
        return key, time.time() - t, f"{type(exc).__name__}: {str(exc)[:200]}"


def precompile(table: dict, workers: int) -> dict:
    """Compile every candidate in a pool of processes (Triton compiles serially within one)."""
    return run_compile_jobs(precompile_jobs(table), workers, _compile_job)


def run_compile_jobs(jobs: list, workers: int, compile_one) -> dict:
    """``compile_one(job) -> (key, seconds, error or None)`` over ``jobs`` in ``workers`` spawned
    processes (fills Triton's on-disk cache); a summary dict (``error`` if the pool itself failed:
    compiling is only a speed-up, autotuning compiles in-process otherwise)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    t = time.time()
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = list(pool.map(compile_one, jobs))
    except Exception as exc:  # noqa: BLE001 - only a speed-up
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "s": time.time() - t}
    errors = {key: err for key, _, err in done if err}
    return {"jobs": len(jobs), "workers": workers, "s": time.time() - t,
            "max_compile_s": max((sec for _, sec, _ in done), default=0.0), "errors": errors}


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=170.0, help="start no new timing after this")
    parser.add_argument("--variants-budget-s", type=float, default=110.0,
                        help="section 0 starts no new timing after this (from the start)")
    parser.add_argument("--smoke", action="store_true", help="toy shapes on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--compile-workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                        help="processes compiling the candidates ahead of autotuning (0: none)")
    args = parser.parse_args()
    t0 = time.time()
    deadline = t0 + args.budget_s
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's float32 matmul stays float32
    if args.smoke:
        DEVICE, table = "cpu", smoke_shapes()
    else:
        table = shapes(MammothARConfig.from_dict(preview_config()[0]["llm_config"]))
    res = {"command": "PYTHONPATH=. python3 benchmarks/gemv.py --out $OUT", "device": DEVICE,
           "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else None, "torch": torch.__version__,
           "triton": triton.__version__, "shapes": table, "tuned_configs": [str(c) for c in G.TUNED_CONFIGS],
           "block_k": G.block_k_for(torch.bfloat16)}

    def save(section: str) -> None:
        res["elapsed_s"] = time.time() - t0
        (out / "gemv.json").write_text(json.dumps(res, indent=2, default=str))
        print(f"-- {section} done at {res['elapsed_s']:.0f}s", flush=True)

    if DEVICE == "cuda" and args.compile_workers:
        res["precompile"] = precompile(table, args.compile_workers)
        print("precompile", json.dumps(res["precompile"])[:600], flush=True)
        save("precompile")
    res["copy_bandwidth_Bps"] = bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    save("ceiling")
    sets = {name: make_weights(shape, weight_copies(shape), seed=i) for i, (name, shape) in enumerate(table.items())}
    res["weight_copies"] = {name: len(s) for name, s in sets.items()}
    sys.modules.setdefault("gemv", sys.modules[__name__])  # section 0 uses this module's helpers and DEVICE
    import gemv_variants

    res["variants"] = gemv_variants.run(table, sets, bandwidth, min(deadline, t0 + args.variants_budget_s), save)
    save("variants")
    res["timings"] = timings = {name: {} for name in table}
    for ms_list in ((1, 16), None, (2, 4, 8)):  # the ends first, then the checks, then the middle
        if ms_list is None:
            res["checks"] = run_checks(table, sets, save)
            continue
        for name, shape in table.items():
            timings[name] |= time_shape(name, shape, sets[name], ms_list, deadline)
            save(f"timings {name} M {ms_list}")
    res["per_token"] = per_token(timings, table, bandwidth)
    print("per visual token (ms):", json.dumps(res["per_token"], indent=1), flush=True)
    save("per token")
    res["explore"] = explore(table, sets, deadline)
    save("exploration")


def run_checks(table: dict, sets: dict, save) -> dict:
    """`check_form` for every shape and form; a failure is recorded and the rest go on."""
    checks = {}
    for name, shape in table.items():
        dtype = sets[name][0]["w"].dtype
        x = torch.randn(16, shape["K"], device=DEVICE).to(dtype)
        residual = torch.randn(16, out_width(shape), device=DEVICE).to(dtype)
        for form in ("fused", "fp8", "plain", "w8a8"):
            try:
                checks[f"{name}/{form}"] = check_form(name, shape, sets[name][0], form, x, residual)
            except Exception as exc:  # noqa: BLE001 - record and go on with the other variants
                checks[f"{name}/{form}"] = f"error: {type(exc).__name__}: {str(exc)[:400]}"
                traceback.print_exc()
        save(f"checks {name}")
    return checks


if __name__ == "__main__":
    main()
