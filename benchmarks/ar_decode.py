"""AR decode on a GPU at MammothModa2-Preview dimensions: correctness, ms/token, tokens/s, floor, baseline.

Run on the GPU machine from the source tree (no install, no checkpoint: random bf16 weights):

    PYTHONPATH=. python benchmarks/ar_decode.py --out "$OUT"

Sections (each printed as it finishes; a table last; everything in ``ar_decode.json`` in --out):
1. ceilings: device-to-device copy bandwidth (bytes read + written), a large bf16 matmul;
2. the AR built from `preview_config()` in bf16, random weights, on the GPU;
3. correctness on the GPU: one 8x8-grid request through the AR stage's `DecodeEngine` (its
   `ARModelRunner` with CUDA graphs) alone and inside a batch of 8 staggered requests of mixed grids,
   against the B=1 `T2ISequence` path (same seed): tokens equal up to the first divergence, relative
   row error; and with ``pad_to_max_bucket`` (one GEMM shape for every step) whether alone == batched
   bit for bit;
4. decode timings (1024x1024 grids, 64x65 tokens) of the engine with the runner's CUDA defaults
   (compiled graphs, fused split-KV attention), driven inline (`DecodeEngine.step`: schedule, launch
   step t+1, read step t back, emit rows): ms/token at batch 1 at image start and at mid-image (a
   prompt as long as the floor's position), aggregate tokens/s at 2, 4, 8 concurrent requests, the
   graph replay alone (CUDA events), kernel profiles of the batch-1 steps (image start, mid-image; default
   runner and the served shape), peak GPU memory
   (weights alone, after the engine's capture, after each run); at batch 1 also the cuBLAS linear,
   padded mode (8 slots) and the served engine's shape (padded, 16 slots of the default
   ``max_sequence_length``: what section 7's process runs); the GEMM + softmax attention path and
   eager graphs with ``--eager``;
5. the per-token HBM floor (bytes one step must read / measured copy bandwidth), bf16 and FP8;
6. FP8 weights (`stage_ar.linear`: the visual-token projections and MLPs converted in place, E4M3
   per output channel): batch 1 and 8 with the default GEMV (float16 products, `stage_ar.gemv`);
   the deviation from bf16 over a greedy image forced in one forward (prefill numerics: cuBLAS on
   widened codes) and over its first `DECODE_CHECK_STEPS` positions one token per forward (the
   decode path's GEMV numerics); ``--fp8-w8a8`` also W8A8's decode deviation and timings, and
   ``--fp8-delayed`` W8A8 with delayed activation scales beside it (deviation teacher-forced through
   the served step, where that form's state lives: `served_decode_rows`; timings);
7. served: a real ``mammoth ar`` process on a Preview-size random checkpoint (`benchmarks/ar_served.py`,
   written once to --ckpt-dir), 10 requests of a 32x32 grid one after another: ms/token, first
   vs tenth request latency (``--served-fp8`` also with ``--weights-dtype fp8``, and with ``--fp8-w8a8``
   ``fp8-w8a8`` too; ``--skip-served``);
8. Hugging Face ``transformers`` ``Qwen2ForCausalLM.generate`` (eager, greedy) at the same
   dimensions as the baseline.

The timings of 4 use the linear backend the AR serves with (`stage_ar.linear.select_backend`
``"auto"``: the Triton GEMV kernels for <= 16 rows); ``compiled_cublas`` is batch 1 with torch matmul
(cuBLAS). One run (without ``--eager``) is meant to stay under 8 minutes on the H200.
"""

from __future__ import annotations

import argparse
import gc
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

from full_size import ceilings, hf_generate_ms_per_token, random_preview_modules  # noqa: E402
from gpu_state import snapshot  # noqa: E402
from sections import run_sections  # noqa: E402

from mammoth_app.make_checkpoint import preview_config  # noqa: E402
from mammoth_core.limits import DEFAULTS  # noqa: E402
from stage_ar.engine import CollectingSink, DecodeEngine, DecodeJob, Role  # noqa: E402
from stage_ar.generation import T2ISequence  # noqa: E402
from stage_ar.linear import TORCH_LINEAR, GemvLinear, quantize_fp8_, select_backend, set_linear_backend  # noqa: E402
from stage_ar.modeling_mammoth_ar import MammothARForCausalLM  # noqa: E402
from stage_ar.sampling import GridConstrainedSampler  # noqa: E402

EOL, VSTART, VEND = 152064, 152072, 152072 + 16384
TIMING_GRID = 64  # 1024x1024
PROMPT = [151644] + list(range(1000, 1060)) + [151645, 152069]  # 63 tokens, as full_size.py
MID = len(PROMPT) + 64 * 65 // 2  # the floor's KV position (mid-image of a 64x64 grid)
MID_GRID = 32  # grid of the mid-image request (its long prompt plus this grid fit the pool)
SAMPLING: dict[str, dict] = {}  # request id -> sampler overrides (temperature 0 = greedy here)


def sampler(w: int, h: int, seed: int, **kw) -> GridConstrainedSampler:
    params = {"temperature": 1.0, "top_k": None, "top_p": 1.0} | kw
    return GridConstrainedSampler(
        w, h, EOL, VSTART, VEND, params["temperature"], params["top_k"], params["top_p"],
        torch.Generator().manual_seed(seed),
    )


def prompt_for(seed: int, length: int = len(PROMPT)) -> list[int]:
    """The benchmark prompt, one token varied by ``seed``, padded to ``length`` with text tokens."""
    return PROMPT[:-1] + [PROMPT[1] + seed] + [1000 + i % 60 for i in range(length - len(PROMPT))] + PROMPT[-1:]


def new_seq(model, w, h, seed, **kw) -> T2ISequence:
    return T2ISequence(model, prompt_for(seed), w, h, sampler(w, h, seed, **kw))


def make_engine(model, slots: int, capacity: int, **opts) -> DecodeEngine:
    """The AR stage's engine (8 admitted at most, ``slots`` KV slots, buckets 1..8), run inline."""
    pad = opts.pop("pad_to_max_bucket", False)

    def make(job: DecodeJob) -> T2ISequence:
        params = sampler(job.ar_width, job.ar_height, job.seed, **SAMPLING.get(job.request_id, {}))
        return T2ISequence(model, job.prompt_ids, job.ar_width, job.ar_height, params,
                           negative_prompt_ids=job.negative_ids, ar_guidance_scale=job.ar_guidance_scale)

    return DecodeEngine(make, 8, model=model, grid_ids=(EOL, VSTART, VEND), max_sequence_length=capacity,
                        batch_invariant=pad, kv_slots=slots, decoder_options={"buckets": (1, 2, 4, 8), **opts})


def job(key: str, w: int, h: int, seed: int, prompt_len: int = len(PROMPT), **kw) -> tuple[DecodeJob, CollectingSink]:
    SAMPLING[key] = kw
    sink = CollectingSink()
    return DecodeJob(request_id=key, epoch=0, prompt_ids=prompt_for(seed, prompt_len), negative_ids=None,
                     ar_width=w, ar_height=h, seed=seed, temperature=0, top_k=0, top_p=0, ar_guidance_scale=0,
                     sink=sink, on_progress=lambda a, b: None, on_done=lambda exc, stats: None), sink


def drive(engine: DecodeEngine, joins: dict[int, list[tuple[DecodeJob, CollectingSink]]]) -> dict[str, CollectingSink]:
    """Submit jobs before given engine steps, run until every job is done; sinks by request id."""
    sinks: dict[str, CollectingSink] = {}
    for step in range(max(joins) + 1):
        for j, sink in joins.get(step, []):
            sinks[j.request_id] = sink
            engine.submit(j)
        engine.step()
    engine.run_until_idle()
    return sinks


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def correctness(model, res: dict) -> None:
    out: dict = {}
    w = h = 8
    ref = new_seq(model, w, h, 0)
    ref_hidden, ref_ids = ref.run()
    others = [(12, 4, 1), (4, 12, 2), (16, 16, 3), (8, 2, 4), (2, 8, 5), (6, 6, 6), (10, 3, 7)]
    n = len(PROMPT)
    for label, opts in (("buckets", {}), ("pad_to_max_bucket", {"pad_to_max_bucket": True})):
        engine = make_engine(model, 8, 512, **opts)
        alone = drive(engine, {0: [job(f"{label}-alone", w, h, 0)]})[f"{label}-alone"]
        joins: dict[int, list] = {0: [job(f"{label}-o0", *others[0])]}
        for j, (ow, oh, seed) in enumerate(others[1:], start=1):
            joins.setdefault(2 * j, []).append(job(f"{label}-o{j}", ow, oh, seed))
        joins.setdefault(5, []).append(job(f"{label}-target", w, h, 0))
        batch = drive(engine, joins)
        a_ids, b_ids = alone.token_ids[Role.CONDITION], batch[f"{label}-target"].token_ids[Role.CONDITION]
        alone_rows, batch_rows = alone.hidden(), batch[f"{label}-target"].hidden()
        div_ref = first_divergence(ref_ids, a_ids)
        upto = len(ref_ids) if div_ref is None else div_ref
        rel = ((alone_rows[:upto].float() - ref_hidden[:upto].float()).norm() / ref_hidden[:upto].float().norm()).item()
        div_batch = first_divergence(a_ids, b_ids)
        out[label] = {
            "grid_tokens": w * (w + 1),
            "alone_vs_B1_reference_first_divergence": None if div_ref is None else div_ref - n,
            "alone_vs_B1_reference_rel_row_error": rel,
            "batched_vs_alone_first_divergence": None if div_batch is None else div_batch - n,
            "batched_vs_alone_rows_bit_identical": bool(torch.equal(alone_rows, batch_rows))
            if alone_rows.shape == batch_rows.shape else False,
            "all_requests_finished": all(sink.finished for sink in batch.values()),
        }
        print(f"correctness [{label}]: {out[label]}", flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    # greedy: batched (graphs) vs the B=1 path
    _, ref_ids = new_seq(model, w, h, 0, temperature=0.0).run()
    engine = make_engine(model, 8, 512)
    greedy = drive(engine, {0: [job("greedy", w, h, 0, temperature=0.0)]})["greedy"]
    out["greedy_alone_vs_B1_reference_first_divergence"] = first_divergence(ref_ids, greedy.token_ids[Role.CONDITION])
    print("greedy:", out["greedy_alone_vs_B1_reference_first_divergence"], flush=True)
    del engine
    res["correctness"] = out


def _profile(graph) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=70)


def _replay_ms(graph) -> float:
    """Median of 3 x (20 replays of ``graph``) per replay, CUDA events; NaN without a graph."""
    if graph is None:
        return float("nan")
    times = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 20)
    return sorted(times)[1]


def _gemv_picks() -> dict:
    """`stage_ar.gemv.tuned_picks` of this process (empty where the tree under test predates it)."""
    from stage_ar import gemv

    return gemv.tuned_picks() if hasattr(gemv, "tuned_picks") else {}


def retune_gemv() -> None:
    """Let the next GEMV launch of each shape tune again, at its own row count
    (`stage_ar.gemv.forget_tuning`): a padded shape timed after batch 1 in one process then runs with
    the picks a served process, which tunes at its padded M, makes."""
    from stage_ar import gemv

    gemv.forget_tuning()


def time_variant(model, res: dict, label: str, opts: dict, batches: tuple[int, ...], steps: int,
                 slots: int = 8, mid_image: bool = False, profile: bool = False, save=None,
                 capacity: int | None = None) -> None:
    """ms/step of ``batches`` concurrent 1024x1024 requests through one `DecodeEngine` built with
    ``opts`` (the engine loop itself: schedule, launch step t+1, read step t back, emit rows).

    ``mid_image``: batch 1 again with a prompt as long as the floor's KV position (and a 32x32 grid
    so it fits the pool), so attention covers what a mid-image step must read. ``capacity``:
    positions per KV slot (default: the timing request's prompt + grid).
    """
    t = res.setdefault("timings", {})
    w = h = TIMING_GRID
    capacity = capacity or len(PROMPT) + h * (w + 1) + 1
    engine = make_engine(model, slots, capacity, **opts)
    runner = engine.runner
    t0 = time.perf_counter()
    engine.run_until_idle()  # captures the graphs (nothing submitted yet)
    t[f"{label}_capture_s"] = time.perf_counter() - t0
    t[f"{label}_graphs"] = runner.graphs_captured
    t[f"{label}_compiled"] = runner.compile
    t[f"{label}_fused_attention"] = runner.fused_attention
    t[f"{label}_engine_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    t[f"{label}_gemv_picks"] = _gemv_picks()  # what the variant's GEMVs run with (compare: ar_served.py's)
    print(f"[{label}] capture {t[f'{label}_capture_s']:.1f} s, {runner.graphs_captured} graphs, "
          f"compiled={runner.compile}, fused_attention={runner.fused_attention}", flush=True)
    runs = [(b, False) for b in batches] + ([(1, True)] if mid_image else [])
    for batch, mid in runs:
        jobs = [job(f"{label}-{batch}-{mid}-{i}", MID_GRID if mid else w, MID_GRID if mid else h, 100 + i,
                    MID if mid else len(PROMPT)) for i in range(batch)]
        for j, _ in jobs:
            engine.submit(j)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()  # prefills every job and launches the first batched step
        torch.cuda.synchronize()
        if batch == 1 and not mid:
            t[f"{label}_prefill_ms"] = (time.perf_counter() - t0) * 1e3
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / steps
        shape = runner.next_shape()
        graph = runner.graph(shape)
        key = f"{label}_B{batch}" + ("_mid" if mid else "")
        t[key] = {
            "ms_per_step": ms, "tokens_per_s": batch * 1e3 / ms, "graph_replay_ms": _replay_ms(graph),
            "shape": list(shape), "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "gpu_state": snapshot(torch.cuda.current_device()),
        }
        print(f"decode [{label}] B={batch}{' mid' if mid else ''}: {t[key]}", flush=True)
        if profile and batch == 1 and graph is not None:  # batch 1 at image start, and mid-image
            try:
                t[f"profile_{key}"] = _profile(graph)
                print(t[f"profile_{key}"], flush=True)
            except Exception as exc:  # noqa: BLE001
                t["profile_error"] = repr(exc)
        for j, _ in jobs:
            j.cancel()
        engine.run_until_idle()
        if save:
            save()
    del engine, runner
    gc.collect()
    torch.cuda.empty_cache()


def timings(model, res: dict, steps: int, save=None, eager: bool = False, padded_only: bool = False) -> None:
    """The default runner (compiled graphs, fused split-KV attention; buckets) at batch 1, image
    start and mid-image, and 2/4/8 concurrent; at batch 1 the GEMM + softmax attention path and
    padded mode (the engine default); eager graphs (``compile=False``) with ``eager``.
    ``padded_only``: only the two padded variants (8 slots; the served engine's shape)."""
    served_backend = select_backend("auto", "cuda")
    res["linear_backend"] = served_backend.name
    if not padded_only:
        time_variant(model, res, "compiled", {}, (1, 2, 4, 8), steps, mid_image=True, profile=True, save=save)
    retune_gemv()  # each padded shape with the GEMV picks its own process would tune (at its M)
    time_variant(model, res, "compiled_pad8", {"pad_to_max_bucket": True}, (1,), steps, mid_image=True,
                 save=save)
    # the served engine's shape (`stage_ar.server.new_engine` with the default settings): 8 running
    # sequences on 16 KV slots of `max_sequence_length` positions, padded (batch-invariant) mode
    retune_gemv()
    time_variant(model, res, "compiled_served_shape", {"pad_to_max_bucket": True}, (1,), steps, slots=16,
                 capacity=min(DEFAULTS.max_sequence_length, model.config.max_position_embeddings), save=save,
                 mid_image=True, profile=True)
    if padded_only:
        return
    set_linear_backend(model, TORCH_LINEAR)
    time_variant(model, res, "compiled_cublas", {}, (1,), steps, slots=1, save=save)  # 1 slot: fewer graphs
    set_linear_backend(model, served_backend)
    if eager:
        time_variant(model, res, "compiled_gemm_attention", {"fused_attention": False}, (1,), steps,
                     mid_image=True, save=save)
        time_variant(model, res, "eager", {"compile": False}, (1, 2, 4, 8), steps, mid_image=True, save=save)


def _teacher_forced(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over ``ids``: float32 last hidden states ``(T, H)`` and the argmax visual code per position."""
    x = torch.tensor(ids, device="cuda")[None]
    with torch.inference_mode():
        h = model(x, torch.arange(x.shape[1], device="cuda")[None], compute_logits=False).last_hidden_state[0]
        return h.float(), model.compute_logits(h, VSTART, VEND).argmax(-1)


def fp8_timings(model, res: dict, steps: int, save=None, grid: int = TIMING_GRID, w8a8: bool = False,
                delayed: bool = False) -> None:
    """Section 6: a greedy bf16 ``grid`` x ``grid`` image, then the visual-token weights converted to
    FP8 in place; the same ids forced through both (relative hidden-state error and argmax agreement
    over the image's positions), then timed (the model stays FP8). ``w8a8``: then the same deviation
    and timings with the GEMV backend's ``fp8_compute="fp8"`` (W8A8, ``fp8_w8a8_*``). ``delayed`` (with
    ``w8a8``): W8A8 with delayed activation scales (`stage_ar.linear.GemvLinear`'s ``"delayed"``), whose
    state lives only in the served step: per-row W8A8 and it teacher-forced through the served step
    (`served_decode_rows`) against bf16 through the same, and it timed (``fp8_w8a8_delayed_*``)."""
    engine = make_engine(model, 1, len(PROMPT) + grid * (grid + 1) + 1, pad_to_max_bucket=True)  # 2 graphs
    sink = drive(engine, {0: [job("fp8-ref", grid, grid, 0, temperature=0.0)]})["fp8-ref"]
    del engine
    ids = sink.token_ids[Role.CONDITION]
    n = len(PROMPT)
    h16, a16 = _teacher_forced(model, ids)
    # the decode path (<= 16 rows: the GEMV kernels, where W8A16 and W8A8 differ; one forward of the
    # whole image above runs cuBLAS on widened codes in both modes)
    forced = torch.tensor(ids[: n + DECODE_CHECK_STEPS], device="cuda")[None]
    d16, c16 = decode_rows(model, forced, n)
    if delayed:
        s16 = served_decode_rows(model, forced, n, grid, (EOL, VSTART, VEND))
    quantize_fp8_(model.visual_token_linears())
    torch.cuda.empty_cache()
    h8, a8 = _teacher_forced(model, ids)
    res["fp8_vs_bf16"] = _deviation(h8, a8, h16, a16, n, grid, len(ids) - n)
    print("FP8 vs bf16 weights (teacher-forced over a greedy bf16 image):", res["fp8_vs_bf16"], flush=True)
    res["floor_fp8"] = fb = floor_bytes(model, MID)
    res["floor_fp8"]["ms_per_token"] = fb["total"] / res["ceilings"]["hbm_bytes_per_s"] * 1e3
    set_linear_backend(model, select_backend("auto", "cuda"))
    res["fp8_decode_vs_bf16"] = _decode_deviation(*decode_rows(model, forced, n), d16, c16)
    print("FP8 (W8A16) vs bf16, decode path:", res["fp8_decode_vs_bf16"], flush=True)
    time_variant(model, res, "fp8", {}, (1, 8), steps, mid_image=True, save=save)
    if w8a8:
        set_linear_backend(model, GemvLinear(fp8_compute="fp8"))
        res["fp8_w8a8_decode_vs_bf16"] = _decode_deviation(*decode_rows(model, forced, n), d16, c16)
        print("W8A8 vs bf16, decode path:", res["fp8_w8a8_decode_vs_bf16"], flush=True)
        if delayed:
            res["fp8_w8a8_served_vs_bf16"] = _decode_deviation(
                *served_decode_rows(model, forced, n, grid, (EOL, VSTART, VEND)), *s16)
            print("W8A8 vs bf16, served step:", res["fp8_w8a8_served_vs_bf16"], flush=True)
        time_variant(model, res, "fp8_w8a8", {}, (1, 8), steps, save=save)
    if w8a8 and delayed:
        set_linear_backend(model, GemvLinear(fp8_compute="fp8", fuse_epilogues=("rope", "swiglu", "delayed")))
        res["fp8_w8a8_delayed_served_vs_bf16"] = _decode_deviation(
            *served_decode_rows(model, forced, n, grid, (EOL, VSTART, VEND)), *s16)
        print("W8A8 delayed scales vs bf16, served step:", res["fp8_w8a8_delayed_served_vs_bf16"], flush=True)
        time_variant(model, res, "fp8_w8a8_delayed", {}, (1, 8), steps, mid_image=True, save=save)
        set_linear_backend(model, GemvLinear(fp8_compute="fp8"))


#: Grid positions the decode-path deviation forces one token per forward (`decode_rows`).
DECODE_CHECK_STEPS = 256


def decode_rows(model, ids: torch.Tensor, prefill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced decode of ``ids (1, T)``: ``prefill`` ids in one forward, then one id per
    forward (the decode path's shapes: <= 16 rows, the GEMV kernels); float32 hidden rows
    ``(T - prefill, H)`` and the argmax generation-vocabulary code of each single-token step."""
    cfg = model.config
    cache = model.new_kv_cache(1, ids.shape[1])
    device = ids.device
    rows, codes = [], []
    with torch.inference_mode():
        model(ids[:, :prefill], torch.arange(prefill, device=device)[None], kv_cache=cache, compute_logits=False)
        for t in range(prefill, ids.shape[1]):
            h = model(ids[:, t : t + 1], torch.tensor([[t]], device=device), kv_cache=cache,
                      compute_logits=False).last_hidden_state[0]
            rows.append(h.float())
            codes.append(model.compute_logits(h, cfg.gen_vocab_start_index).argmax(-1))
    return torch.cat(rows), torch.cat(codes)


def served_decode_rows(model, ids: torch.Tensor, prefill: int, grid: int,
                       grid_ids: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced decode of ``ids (1, T)`` through the served step (`stage_ar.runner.ARModelRunner`:
    one pool slot, the split-KV Triton attention, eager steps): ``prefill`` ids prefilled, then each
    step fed the next forced id (written over the slot's next token before the step launches) for
    ``T - prefill`` steps of a ``grid`` x ``grid`` image (``grid_ids``: EOL, first and end visual id).
    Returns float32 hidden rows ``(T - prefill, H)`` and each row's argmax visual code (ids
    ``[first, end)``, as `decode_rows`' over the generation vocabulary when ``first`` is its start)."""
    from stage_ar.runner import ARModelRunner

    eol, vstart, vend = grid_ids
    steps = ids.shape[1] - prefill
    params = GridConstrainedSampler(grid, grid, eol, vstart, vend, 0.0, None, 1.0, torch.Generator().manual_seed(0))
    seq = T2ISequence(model, ids[0, :prefill].tolist(), grid, grid, params)
    if seq.grid_tokens < steps:
        raise ValueError(f"a {grid} x {grid} grid has {seq.grid_tokens} tokens, fewer than the {steps} forced")
    runner = ARModelRunner(model, 1, prefill + seq.grid_tokens + 2, eol_token_id=eol, visual_token_start_id=vstart,
                           visual_token_end_id=vend, exact_rows=False, fused_attention=True, compile=False)
    seq.attach_kv_cache(runner.kv_view(0, seq.cache_batch))
    with torch.inference_mode():
        seq.prefill()
        runner.activate("forced", seq, 0)
        rows, codes = [], []
        for t in range(prefill, ids.shape[1]):
            runner.next_token[0] = ids[0, t]
            pending = runner.launch()
            fed, _ = runner.collect(pending)
            if fed[0] != int(ids[0, t]):
                raise RuntimeError(f"step {t - prefill} fed {fed[0]}, not the forced {int(ids[0, t])}")
            h = pending.hidden[:1]
            rows.append(h.float())
            codes.append(model.compute_logits(h, vstart, vend).argmax(-1) + vstart - model.config.gen_vocab_start_index)
        runner.deactivate(0)
    return torch.cat(rows), torch.cat(codes)


def _decode_deviation(h, a, h16, a16) -> dict:
    """Relative / max hidden-state error and argmax agreement of rows ``h`` and codes ``a`` against
    bf16's ``h16`` and ``a16`` (same positions)."""
    return {"steps": int(h.shape[0]), "rel_hidden_error": float((h - h16).norm() / h16.norm()),
            "max_abs_hidden_error": float((h - h16).abs().max()), "argmax_agreement": float((a == a16).float().mean())}


def _deviation(h, a, h16, a16, n: int, grid: int, positions: int) -> dict:
    """`_decode_deviation` of ``(h, a)`` against bf16's past the prompt of ``n`` tokens (the argmax
    at position ``i`` predicts token ``i + 1``)."""
    deviation = _decode_deviation(h[n:], a[n - 1 : -1], h16[n:], a16[n - 1 : -1])
    del deviation["steps"]
    return {"grid": grid, "positions": positions, **deviation}


def floor_bytes(model: MammothARForCausalLM, position: int) -> dict:
    """Bytes one decode step of one visual token must read (MODEL.md routing, issue-8 definition)."""
    lm = model.language_model
    total = 0
    for layer in lm.layers:
        a = layer.self_attn
        projs = [a.gen_qkv_proj, a.gen_o_proj] if a.has_experts else [a.qkv_proj, a.o_proj]
        mlp = layer.gen_mlp if layer.gen_mlp is not None else layer.mlp
        mods = projs + [mlp, layer.input_layernorm, layer.post_attention_layernorm]
        tensors = [t for m in mods for t in (*m.parameters(), *m.buffers())]  # FP8: codes + row scales
        total += sum(t.numel() * t.element_size() for t in tensors)
    total += lm.norm.weight.numel() * lm.norm.weight.element_size()
    h = model.config.hidden_size
    head = (VEND - VSTART + 1) * h * 2
    cfg = model.config
    kv = cfg.num_hidden_layers * 2 * position * cfg.num_key_value_heads * cfg.head_dim * 2
    return {"weights": total, "head_rows": head, "kv": kv, "total": total + head + kv}


def hf_baseline(lc: dict, res: dict) -> None:
    """The baseline: HF ``generate`` at the same dimensions, random weights (seed 3), 64 tokens."""
    res["hf_ms_per_token"] = hf_generate_ms_per_token(lc, PROMPT, 64, init_seed=3)
    print(f"HF transformers generate (eager, greedy): {res['hf_ms_per_token']:.2f} ms/token", flush=True)


#: ``--weights-dtype`` of a served process -> its result key, and the in-process variant it is held to.
SERVED_KEYS = {"auto": "served", "fp8": "served_fp8", "fp8-w8a8": "served_fp8_w8a8"}
SERVED_REFERENCE = {"served": "compiled_B1", "served_fp8": "fp8_B1", "served_fp8_w8a8": "fp8_w8a8_B1"}


def served(res: dict, args, save) -> None:
    """Section 7 (`benchmarks/ar_served.py`): bf16; FP8 (W8A16) with ``--served-fp8``, and W8A8 too
    (``--weights-dtype fp8-w8a8``) with ``--served-fp8 --fp8-w8a8``."""
    import ar_served

    try:
        checkpoint = ar_served.preview_checkpoint(pathlib.Path(args.ckpt_dir))
        dtypes = ("auto", "fp8", "fp8-w8a8") if args.served_fp8 and args.fp8_w8a8 else \
            ("auto", "fp8") if args.served_fp8 else ("auto",)
        for dtype in dtypes:
            key = SERVED_KEYS[dtype]
            res[key] = ar_served.run(checkpoint, requests=10, grid=32, extra=["--weights-dtype", dtype])
            print(key, json.dumps({k: v for k, v in res[key].items() if k not in ("requests", "ar_log_tail")}),
                  flush=True)
            save()
    except Exception:  # noqa: BLE001 - keep the other sections
        res.setdefault("errors", []).append(traceback.format_exc())
        print(traceback.format_exc(), flush=True)


def print_summary(res: dict) -> None:
    """The side-by-side table (markdown) of everything measured."""
    bw = res["ceilings"]["hbm_bytes_per_s"]
    t = res.get("timings", {})
    timed = {k: v for k, v in t.items() if isinstance(v, dict) and "ms_per_step" in v}  # not the picks' dicts
    floor = res["floor"]["ms_per_token"]
    print("\n| quantity | value |\n| --- | --- |")
    print(f"| copy bandwidth (read+write) | {bw / 1e12:.2f} TB/s |")
    print(f"| bf16 matmul 8192^3 | {res['ceilings']['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s |")
    print(f"| floor per token (B=1, pos {MID}), bf16 | {floor:.3f} ms ({res['floor']['total'] / 1e9:.2f} GB) |")
    if "floor_fp8" in res:
        print(f"| floor per token, FP8 weights | {res['floor_fp8']['ms_per_token']:.3f} ms "
              f"({res['floor_fp8']['total'] / 1e9:.2f} GB) |")
    print(f"| GPU memory: weights / after capture / peak | {res['weights_gib']:.2f} / "
          f"{t.get('compiled_engine_peak_gib', float('nan')):.2f} / "
          f"{max([v['peak_gib'] for v in timed.values()] or [float('nan')]):.2f} GiB |")
    for key, v in sorted(timed.items()):
        fp8 = key.startswith("fp8") and "floor_fp8" in res  # against the floor of the bytes it reads
        ref, which = (res["floor_fp8"]["ms_per_token"], "FP8 floor") if fp8 else (floor, "floor")
        print(f"| {key} | {v['ms_per_step']:.3f} ms/step ({v['ms_per_step'] / ref:.2f} x {which}), "
              f"{v['tokens_per_s']:.1f} tok/s, replay {v['graph_replay_ms']:.3f} ms, shape {v['shape']} |")
    if "compiled_B1" in t:
        b1 = t["compiled_B1"]
        print(f"| B=1 / floor | {b1['ms_per_step'] / floor:.2f} x (target <= 1.3) |")
        if "hf_ms_per_token" in res:
            print(f"| HF eager generate | {res['hf_ms_per_token']:.2f} ms/token; speed-up "
                  f"{res['hf_ms_per_token'] / b1['ms_per_step']:.1f} x (target >= 4) |")
        if "compiled_B8" in t:
            print(f"| B=8 tok/s / B=1 tok/s | {t['compiled_B8']['tokens_per_s'] / b1['tokens_per_s']:.2f} x "
                  f"(target >= 6) |")
    if "compiled_prefill_ms" in t:
        print(f"| prefill 63 tokens | {t['compiled_prefill_ms']:.1f} ms |")
    if "fp8_B1" in t:
        print(f"| FP8 B=1 | {t['fp8_B1']['ms_per_step']:.3f} ms/token (target <= 2.1; "
              f"{t['fp8_B1']['ms_per_step'] / res['floor_fp8']['ms_per_token']:.2f} x FP8 floor) |")
    if "fp8_vs_bf16" in res:
        d = res["fp8_vs_bf16"]
        print(f"| FP8 vs bf16, {d['grid']}x{d['grid']} grid forced | relative hidden error {d['rel_hidden_error']:.4f}, "
              f"argmax agreement {d['argmax_agreement']:.4f} |")
    for key, label, path in (("fp8_decode_vs_bf16", "FP8 W8A16", "decode path"),
                             ("fp8_w8a8_decode_vs_bf16", "FP8 W8A8", "decode path"),
                             ("fp8_w8a8_served_vs_bf16", "FP8 W8A8", "served step"),
                             ("fp8_w8a8_delayed_served_vs_bf16", "FP8 W8A8 delayed scales", "served step")):
        if key in res:
            d = res[key]
            print(f"| {label} vs bf16, {path}, {d['steps']} forced steps | relative hidden error "
                  f"{d['rel_hidden_error']:.4f}, argmax agreement {d['argmax_agreement']:.4f} |")
    if "fp8_w8a8_B1" in t:
        print(f"| FP8 W8A8 B=1 | {t['fp8_w8a8_B1']['ms_per_step']:.3f} ms/token (float16 mode: "
              f"{t.get('fp8_B1', {}).get('ms_per_step', float('nan')):.3f}) |")
    if "fp8_w8a8_delayed_B1" in t:
        print(f"| FP8 W8A8 delayed scales B=1 | {t['fp8_w8a8_delayed_B1']['ms_per_step']:.3f} ms/token |")
    if "fp8_B8" in t and "fp8_B1" in t:
        print(f"| FP8 B=8 tok/s / B=1 tok/s | {t['fp8_B8']['tokens_per_s'] / t['fp8_B1']['tokens_per_s']:.2f} x "
              f"(target >= 7) |")
    for key, reference in SERVED_REFERENCE.items():
        if key in res:
            v = res[key]
            ref = t.get(reference, {}).get("ms_per_step", float("nan"))
            inline = t.get("compiled_served_shape_B1", {}) if key == "served" else {}  # bf16's only
            pad = (f"; {v['ms_per_token_median'] / inline['ms_per_step']:.3f} x its served shape inline"
                   if "ms_per_step" in inline else "")
            print(f"| {key}: mammoth ar, 32x32 grid, 10 requests | {v['ms_per_token_median']:.3f} ms/token "
                  f"({v['ms_per_token_median'] / ref:.3f} x the benchmark's B=1, target <= 1.05{pad}); first "
                  f"{v['first_wall_ms']:.0f} ms vs tenth {v['last_wall_ms']:.0f} ms ({v['first_over_last']:.2f} x, "
                  f"target <= 1.10); ready after {v['ready_s']:.0f} s |")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--eager", action="store_true",
                        help="also time eager graphs (compile=False) and the GEMM attention path")
    parser.add_argument("--skip-served", action="store_true", help="skip section 7 (a real mammoth ar process)")
    parser.add_argument("--served-fp8", action="store_true", help="section 7 also with --weights-dtype fp8")
    parser.add_argument("--fp8-w8a8", action="store_true", help="section 6 also with W8A8 (fp8_compute='fp8')")
    parser.add_argument("--fp8-delayed", action="store_true",
                        help="section 6 also with W8A8's delayed activation scales (with --fp8-w8a8; an experiment)")
    parser.add_argument("--ckpt-dir", default="/tmp/mammoth-preview-ckpt", help="section 7's checkpoint")
    parser.add_argument("--padded-only", action="store_true",
                        help="section 4 with only the padded variants (8 slots, the served shape); no 3, 6, 7, 8")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "command": "PYTHONPATH=. python benchmarks/ar_decode.py --out $OUT",
    }
    print(f"GPU {res['gpu']}, torch {res['torch']}", flush=True)
    res["ceilings"] = ceilings()
    print("ceilings", res["ceilings"], flush=True)
    config, _ = preview_config()
    lc = config["llm_config"]
    torch.cuda.reset_peak_memory_stats()
    model, _ = random_preview_modules(config, dit=False)
    model.eval().requires_grad_(False)
    set_linear_backend(model, select_backend("auto", "cuda"))  # as `load_ar` does for the served AR
    res["weights_gib"] = torch.cuda.max_memory_allocated() / 2**30
    def save() -> None:
        (out / "ar_decode.json").write_text(json.dumps(res, indent=2, default=str))

    bw = res["ceilings"]["hbm_bytes_per_s"]
    mid = len(PROMPT) + 64 * 65 // 2
    fb = floor_bytes(model, mid)
    res["floor"] = {**fb, "position": mid, "ms_per_token": fb["total"] / bw * 1e3}
    save()
    if args.padded_only:
        args.skip_correctness = args.skip_served = args.skip_hf = True
    run_sections(res, (
        lambda: timings(model, res, args.steps, save, eager=args.eager, padded_only=args.padded_only),
        (lambda: correctness(model, res)) if not args.skip_correctness else None,
        (lambda: fp8_timings(model, res, args.steps, save, w8a8=args.fp8_w8a8, delayed=args.fp8_delayed))
        if not args.padded_only else None,
    ), save)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    if not args.skip_served:
        served(res, args, save)
    if not args.skip_hf:
        try:
            hf_baseline(lc, res)
        except Exception:  # noqa: BLE001
            res["hf_error"] = traceback.format_exc()
            print(res["hf_error"], flush=True)
    (out / "ar_decode.json").write_text(json.dumps(res, indent=2, default=str))

    print_summary(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
