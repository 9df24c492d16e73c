"""What one DiT CFG step spends its time on, and which kernel choices make it faster (one GPU).

Run on the GPU machine from the source tree (random Preview-size bf16 weights, no checkpoint):

    PYTHONPATH=. python3 benchmarks/dit_profile.py --out "$OUT"

Per size (512² and 1024², one request, both CFG branches, 128 condition rows, as `dit_step.py`):

- ``variants``: ms/step (median of CUDA-event timings) of the eager block (`stage_dit.fused` off),
  the fused block, and the fused block with each SDPA backend forced (`modules.SDPA_BACKENDS`:
  cuDNN, flash, memory-efficient);
- ``profile``: `torch.profiler` kernel time of one step by category (GEMM, attention, fused Triton,
  norm, other elementwise) and the gap (step wall time minus kernel time), eager and fused;
- ``attention``: one SDPA call at the step's shapes (24 query / 8 KV heads, head_dim 96) per backend,
  and cuDNN with head_dim zero-padded to 128;
- ``graph``: the transformer forward eager vs replayed as one CUDA graph.

Then ``bound``: a request batched with three others vs alone (bf16, the worker loop) against bf16 vs
float32 alone (`tests/unit/test_dit_batching.py::test_cuda_batched_within_bf16_bound`, at
Preview size, 512²/4 steps), and ``latency_512``: one 512²/20 image through `DiTEngine` vs the
pipeline called directly (warm, 3 each; the engine's own timings split denoise / VAE / encode).
``--tiny``: tiny dimensions on the CPU (a smoke test of the script). Output: ``dit_profile.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import threading
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.dit_batching import build_pipeline, timed_ms  # noqa: E402
from stage_dit import fused, modules  # noqa: E402
from stage_dit.denoise import DenoiseState, ImageRequest, denoise_step, pad_conditions  # noqa: E402
from stage_dit.graphs import GraphCache  # noqa: E402

CATEGORIES = (("fused", ("_rms_modulate", "_gated_residual", "_qk_norm_rope", "_silu_mul")),
              ("attention", ("sdpa", "flash", "fmha", "attention", "cudnn")),
              ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "sm90")),
              ("norm", ("layer_norm", "rms_norm")))


def step_fn(pipe, size: int, condition, steps: int = 50, graphs=None):
    latents = pipe.prepare_latents(width=size, height=size, seed=0)

    def step():
        state = DenoiseState(pipe, ImageRequest(condition, None, size, size, steps, 9.0), latents)
        denoise_step(pipe.transformer, [state], graphs)
    return step


def profile_step(step, wall_ms: float) -> dict:
    """Kernel milliseconds of one step by category, the top kernels and the gap to ``wall_ms``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    cats: dict[str, float] = {}
    rows = []
    for e in prof.key_averages():
        ms = getattr(e, "self_device_time_total", 0.0) / 1e3
        if ms <= 0 or e.key.startswith(("aten::", "cuda")):
            continue
        name = e.key.lower()
        cat = next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "elementwise")
        cats[cat] = cats.get(cat, 0.0) + ms
        rows.append({"kernel": e.key[:100], "ms": ms, "calls": e.count, "category": cat})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(cats.values())
    return {"kernel_ms": total, "gap_ms": wall_ms - total, "by_category_ms": cats, "top": rows[:14],
            "launches": sum(r["calls"] for r in rows)}


def attention_micro(seq: int, repeat: int = 20) -> dict:
    """One SDPA call per backend at (1, 24, seq, 96) queries and (1, 8, seq, 96) keys/values."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 24, seq, 96, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, seq, 96, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flops = 4 * seq * seq * 96 * 24
    out: dict = {}
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                ms = timed_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                              repeat, True)
            out[name] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as exc:  # a backend that does not take these shapes
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
    pad = lambda x: torch.nn.functional.pad(x, (0, 32))  # noqa: E731
    try:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            ms = timed_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                pad(q), pad(k), pad(v), enable_gqa=True, scale=96 ** -0.5)[..., :96], repeat, True)
        out["CUDNN_pad128"] = {"ms": ms, "tflops": flops / ms / 1e9}
    except Exception as exc:
        out["CUDNN_pad128"] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
    return out


def graph_vs_eager(pipe, size: int, condition, repeat: int) -> dict:
    """The transformer forward of one CFG step eager vs one captured CUDA graph (static inputs)."""
    tr = pipe.transformer
    latents = pipe.prepare_latents(width=size, height=size, seed=0).repeat(2, 1, 1, 1)
    conds = [condition, condition.new_zeros(0, condition.shape[1])]
    text, mask = pad_conditions(conds)
    t = torch.full((2,), 0.5, device=latents.device)
    lengths = [c.shape[0] for c in conds]

    def forward():
        return tr.unpatchify(tr.run_layers(tr.embed(latents, t, text, mask, caption_lengths=lengths), 0, len(tr.layers)))
    eager_ms = timed_ms(forward, repeat, True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    graph_ms = timed_ms(graph.replay, repeat, True)
    ref = forward()
    return {"eager_ms": eager_ms, "graph_ms": graph_ms, "max_abs_diff": float((out - ref).abs().max())}


def measure_size(pipe, size: int, condition, repeat: int, cuda: bool) -> dict:
    from torch.nn.attention import SDPBackend

    entry: dict = {"variants": {}}
    step = step_fn(pipe, size, condition)
    variants = [("eager", False, None), ("fused", True, None)]
    if cuda:
        variants += [(f"fused+{b}", True, [getattr(SDPBackend, b)])
                     for b in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")]
    for name, on, backends in variants:
        fused.ENABLED, modules.SDPA_BACKENDS = on, backends
        try:
            with torch.inference_mode():
                entry["variants"][name] = timed_ms(step, repeat, cuda)
                if cuda and name in ("eager", "fused"):
                    entry.setdefault("profile", {})[name] = profile_step(step, entry["variants"][name])
        except Exception as exc:
            entry["variants"][name] = f"{type(exc).__name__}: {str(exc)[:160]}"
    fused.ENABLED, modules.SDPA_BACKENDS = True, None
    if cuda:
        with torch.inference_mode():
            entry["attention"] = attention_micro((size // 16) ** 2 + condition.shape[0])
            try:
                entry["graph"] = graph_vs_eager(pipe, size, condition, repeat)
            except Exception as exc:
                entry["graph"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    print(json.dumps({size: {k: v for k, v in entry.items() if k != "profile"}}), flush=True)
    return entry


def bound_check(pipe, size: int, steps: int, condition) -> dict:
    """Batched vs alone (bf16) against bf16 vs float32 alone, latents max abs deviation per request."""
    from stage_dit.engine import DiTEngine, EngineJob, ImageFinished

    rows = condition.shape[0]
    reqs = [ImageRequest(condition[: rows - rows // 8 * i], None, size, size, steps, 1.0 + 2 * i, seed=i) for i in range(4)]
    outs: dict[int, torch.Tensor] = {}
    done = threading.Semaphore(0)
    engine = DiTEngine(pipe, max_batch_requests=4)
    try:
        for i, r in enumerate(reqs):
            def sink(ev, i=i):
                if isinstance(ev, ImageFinished):
                    outs[i] = ev.output
                    done.release()
            engine.submit(EngineJob(prepare=lambda r=r: r, sink=sink, output_type="latent"))
        for _ in reqs:
            done.acquire(timeout=300)
    finally:
        engine.close()
    alone = [pipe(r, output_type="latent") for r in reqs]
    dtype, graphs = pipe.dtype, pipe.step_graphs
    torch.nn.Module.float(pipe.transformer)  # new parameter tensors: graphs of the old ones are stale
    pipe.dtype = torch.float32
    pipe.step_graphs = GraphCache() if graphs is not None else None
    try:
        exact = [pipe(ImageRequest(r.condition.float(), None, size, size, steps, r.text_guidance_scale,
                                   seed=r.seed), output_type="latent") for r in reqs]
    finally:
        torch.nn.Module.to(pipe.transformer, dtype)
        pipe.dtype = dtype
        pipe.step_graphs = GraphCache() if graphs is not None else None
    res = [{"batched_vs_alone": float((outs[i] - alone[i]).abs().max()),
            "bf16_vs_fp32": float((alone[i] - exact[i]).abs().max()),
            "batched_vs_fp32": float((outs[i] - exact[i]).abs().max())} for i in range(len(reqs))]
    return {"size": size, "steps": steps, "requests": res,
            "within_bound": all(r["batched_vs_alone"] <= 2 * r["bf16_vs_fp32"] for r in res),
            "largest_ratio": max(r["batched_vs_alone"] / max(r["bf16_vs_fp32"], 1e-30) for r in res)}


def engine_image(engine, request: ImageRequest, output_type: str) -> tuple[object, object, float]:
    """One request through ``engine``: (output, `ImageTimings`, seconds from submit to the image)."""
    from stage_dit.engine import EngineJob, ImageFinished, RequestFailed

    finished, box = threading.Event(), {}

    def sink(ev):
        if isinstance(ev, (ImageFinished, RequestFailed)):
            box["t"], box["ev"] = time.perf_counter(), ev
            finished.set()
    t0 = time.perf_counter()
    engine.submit(EngineJob(prepare=lambda: request, sink=sink, output_type=output_type))
    finished.wait(300)
    ev = box["ev"]
    if isinstance(ev, RequestFailed):
        raise ev.error
    return ev.output, ev.timings, box["t"] - t0


def latency(pipe, size: int, steps: int, condition, runs: int) -> dict:
    """One image at a time: through `DiTEngine` (PNG) vs ``pipe(request, output_type="png")``."""
    from stage_dit.engine import DiTEngine

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    req = ImageRequest(condition, None, size, size, steps, 9.0, seed=1)
    direct = []
    for _ in range(runs + 1):
        sync()
        t0 = time.perf_counter()
        pipe(req, output_type="png")
        direct.append(time.perf_counter() - t0)
    engine = DiTEngine(pipe, max_batch_requests=8)
    through, timings = [], []
    try:
        for _ in range(runs + 1):
            _, tm, seconds = engine_image(engine, req, "png")
            through.append(seconds)
            timings.append(vars(tm))
    finally:
        engine.close()
    return {"direct_s": statistics.median(direct[1:]), "engine_s": statistics.median(through[1:]),
            "direct_all": direct, "engine_all": through, "engine_timings": timings}


def step_cache(pipe, size: int, steps: int, condition, thresholds) -> dict:
    """The opt-in step cache (lossy): steps skipped, seconds per image and pixel deviation from the
    uncached image (max and mean on the [-1, 1] scale), one request at a time through `DiTEngine`."""
    from stage_dit.engine import DiTEngine
    from stage_dit.step_cache import StepCacheConfig

    engine = DiTEngine(pipe, max_batch_requests=1)
    out: dict = {"size": size, "steps": steps}
    try:
        base, tm, seconds = engine_image(engine, ImageRequest(condition, None, size, size, steps, 9.0, seed=3), "pt")
        out["off"] = {"seconds": seconds, "denoise_ms": tm.denoise_ms}
        for th in thresholds:
            req = ImageRequest(condition, None, size, size, steps, 9.0, seed=3, cache=StepCacheConfig(th, 2))
            img, tm, seconds = engine_image(engine, req, "pt")
            diff = (img - base).abs()
            out[str(th)] = {"skipped": tm.steps_skipped, "seconds": seconds, "denoise_ms": tm.denoise_ms,
                            "max_dev": float(diff.max()), "mean_dev": float(diff.mean())}
    finally:
        engine.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = not args.tiny
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "torch": torch.__version__}
    if cuda:
        from benchmarks.full_size import ceilings

        res["gpu"] = torch.cuda.get_device_name(0)
        res["ceilings"] = ceilings()
    pipe = build_pipeline(args.tiny)
    rows = 128 if cuda else 16
    condition = torch.randn(rows, pipe.llm_hidden_size, device=pipe.device, dtype=pipe.dtype)
    sizes = (1024, 512) if cuda else (64, 32)
    res["sizes"] = {}
    for size in sizes:
        res["sizes"][str(size)] = measure_size(pipe, size, condition, args.repeat, cuda)
        (out / "dit_profile.json").write_text(json.dumps(res, indent=2))
    with torch.inference_mode():
        for key, fn in (("latency_512", lambda: latency(pipe, sizes[1], 20 if cuda else 4, condition, 3)),
                        ("bound", lambda: bound_check(pipe, sizes[1], 4, condition)),
                        ("cache_512", lambda: step_cache(pipe, sizes[1], 20 if cuda else 6, condition, (0.1, 0.3, 0.6, 1.0))),
                        ("cache_1024", lambda: step_cache(pipe, sizes[0], 50 if cuda else 6, condition, (0.3, 1.0)))):
            try:
                res[key] = fn()
            except Exception as exc:
                res[key] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(json.dumps({key: res[key]}), flush=True)
            (out / "dit_profile.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def step_report(pipe, size: int, condition, repeat: int = 10) -> dict:
    """What remains of one CFG step at ``size``²: the eager (fused-kernel) step, its profile by
    category, and the forward eager vs replayed as a CUDA graph (CUDA only)."""
    with torch.inference_mode():
        step = step_fn(pipe, size, condition)
        cuda = pipe.device.type == "cuda"
        report: dict = {"eager_step_ms": timed_ms(step, repeat, cuda)}
        if cuda:
            report["profile"] = profile_step(step, report["eager_step_ms"])
            report["graph"] = graph_vs_eager(pipe, size, condition, repeat)
    return report


def extras(pipe, condition, result: dict, out: pathlib.Path, sizes: list[int]) -> None:
    """`benchmarks/dit_batching.py --extras`: per size `step_report`, then `bound_check` and
    `step_cache` (opt-in, lossy), each stored in ``result`` and written to ``out`` as it finishes."""
    cuda = pipe.device.type == "cuda"
    small, large = sizes[0], sizes[-1]
    parts = [(f"step_{size}", lambda size=size: step_report(pipe, size, condition)) for size in sizes]
    parts += [("bound", lambda: bound_check(pipe, small, 4, condition)),
              (f"cache_{small}", lambda: step_cache(pipe, small, 20 if cuda else 6, condition, (1.0, 1.5, 2.0))),
              (f"cache_{large}", lambda: step_cache(pipe, large, 50 if cuda else 6, condition, (1.5,)))]
    for key, fn in parts:
        try:
            result[key] = fn()
        except Exception as exc:  # keep what the other parts measure
            result[key] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps({key: result[key]})[:3000], flush=True)
        out.write_text(json.dumps(result))
