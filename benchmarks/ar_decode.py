"""AR decode on a GPU at MammothModa2-Preview dimensions: correctness, ms/token, tokens/s, floor, baseline.

Run on the GPU machine from the source tree (no install, no checkpoint: random bf16 weights):

    PYTHONPATH=. python benchmarks/ar_decode.py --out "$OUT"

Sections (each printed as it finishes; a table last; everything in ``ar_decode.json`` in --out):
1. ceilings: device-to-device copy bandwidth (bytes read + written), a large bf16 matmul;
2. the AR built from `preview_config()` in bf16, random weights, on the GPU;
3. correctness on the GPU: one 8x8-grid request through `BatchedDecoder` (CUDA graphs) alone and
   inside a batch of 8 staggered requests of mixed grids, against the B=1 `T2ISequence` path
   (same seed): tokens equal up to the first divergence, relative row error; and with
   ``pad_to_max_bucket`` (one GEMM shape for every step) whether alone == batched bit for bit;
4. decode timings (1024x1024 grids, 64x65 tokens) of the `BatchedDecoder` default on CUDA
   (compiled graphs, fused split-KV attention): ms/token at batch 1 (engine-style loop: launch step
   t+1, then read step t's ids) at image start and at mid-image (the slot's cache position moved to
   the floor's position), aggregate tokens/s at 2, 4, 8 concurrent requests, the graph replay alone
   (CUDA events), a kernel profile of the mid-image batch-1 step; at batch 1 also the GEMM +
   softmax attention path and padded mode; eager graphs with ``--eager``;
5. the per-token HBM floor (bytes one step must read / measured copy bandwidth);
6. Hugging Face ``transformers`` ``Qwen2ForCausalLM.generate`` (eager, greedy) at the same
   dimensions as the baseline.
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

from mammoth_core.make_checkpoint import preview_config  # noqa: E402
from stage_ar.batch_engine import BatchedDecoder  # noqa: E402
from stage_ar.generation import T2ISequence  # noqa: E402
from stage_ar.modeling_mammoth_ar import MammothARForCausalLM  # noqa: E402
from stage_ar.sampling import GridConstrainedSampler  # noqa: E402

EOL, VSTART, VEND = 152064, 152072, 152072 + 16384
TIMING_GRID = 64  # 1024x1024
PROMPT = [151644] + list(range(1000, 1060)) + [151645, 152069]  # 63 tokens, as full_size.py


def sampler(w: int, h: int, seed: int, **kw) -> GridConstrainedSampler:
    params = {"temperature": 1.0, "top_k": None, "top_p": 1.0} | kw
    return GridConstrainedSampler(
        w, h, EOL, VSTART, VEND, params["temperature"], params["top_k"], params["top_p"],
        torch.Generator().manual_seed(seed),
    )


def new_seq(model, w, h, seed, **kw) -> T2ISequence:
    prompt = PROMPT[:-1] + [PROMPT[1] + seed] + PROMPT[-1:]
    return T2ISequence(model, prompt, w, h, sampler(w, h, seed, **kw))


def make_decoder(model, slots: int, capacity: int, **kw) -> BatchedDecoder:
    return BatchedDecoder(model, slots, capacity, eol_token_id=EOL, visual_token_start_id=VSTART,
                          visual_token_end_id=VEND, buckets=(1, 2, 4, 8), **kw)


def drive(decoder: BatchedDecoder, joins: dict[int, list[tuple[int, T2ISequence]]], max_steps: int | None = None):
    """Engine-style loop: join at given steps, launch step t+1 before reading step t. Returns rows per key."""
    rows: dict[int, list[torch.Tensor]] = {}
    seqs: dict[int, T2ISequence] = {}
    pending = None
    step = 0

    def emit(p):
        fed, sampled = decoder.collect(p)
        for e in p.entries:
            seqs[e.key].record_external_step(fed[e.slot], sampled[e.slot])
            rows[e.key].append(p.hidden[e.slot : e.slot + 1])

    while True:
        for key, seq in joins.get(step, []):
            seqs[key] = seq
            first = decoder.reserve(seq)
            rows[key] = [seq.prefill().hidden]
            decoder.activate(key, seq, first)
        launched = decoder.launch()
        if pending is not None:
            emit(pending)
        pending = launched
        step += 1
        if (launched is None and step > max(joins)) or (max_steps is not None and step >= max_steps):
            break
    if pending is not None:
        emit(pending)
    return {k: torch.cat(v) for k, v in rows.items()}, seqs


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
    for label, opts in (("buckets", {}), ("pad_to_max_bucket", {"pad_to_max_bucket": True})):
        dec = make_decoder(model, 8, 512, **opts)
        dec.capture()
        alone, alone_seqs = drive(dec, {0: [(0, new_seq(model, w, h, 0))]})
        alone_rows = alone[0]
        joins: dict[int, list] = {0: [(1, new_seq(model, *others[0][:2], others[0][2]))]}
        for j, (ow, oh, seed) in enumerate(others[1:], start=1):
            joins.setdefault(2 * j, []).append((j + 1, new_seq(model, ow, oh, seed)))
        joins.setdefault(5, []).append((0, new_seq(model, w, h, 0)))
        batch_rows, batch_seqs = drive(dec, joins)
        a_ids = alone_seqs[0].prompt_ids + alone_seqs[0].generated_ids
        b_ids = batch_seqs[0].prompt_ids + batch_seqs[0].generated_ids
        n = len(PROMPT)
        div_ref = first_divergence(ref_ids, a_ids)
        upto = len(ref_ids) if div_ref is None else div_ref
        rel = ((alone_rows[:upto].float() - ref_hidden[:upto].float()).norm() / ref_hidden[:upto].float().norm()).item()
        out[label] = {
            "grid_tokens": w * (w + 1),
            "alone_vs_B1_reference_first_divergence": None if div_ref is None else div_ref - n,
            "alone_vs_B1_reference_rel_row_error": rel,
            "batched_vs_alone_first_divergence": (
                None if first_divergence(a_ids, b_ids) is None else first_divergence(a_ids, b_ids) - n),
            "batched_vs_alone_rows_bit_identical": bool(torch.equal(alone_rows, batch_rows[0]))
            if alone_rows.shape == batch_rows[0].shape else False,
            "all_requests_finished": all(s.finished for s in batch_seqs.values()),
        }
        print(f"correctness [{label}]: {out[label]}", flush=True)
        del dec
        gc.collect()
        torch.cuda.empty_cache()
    # greedy: batched (graphs) vs the B=1 path
    ref = new_seq(model, w, h, 0, temperature=0.0)
    _, ref_ids = ref.run()
    dec = make_decoder(model, 8, 512)
    dec.capture()
    _, seqs = drive(dec, {0: [(0, new_seq(model, w, h, 0, temperature=0.0))]})
    g_ids = seqs[0].prompt_ids + seqs[0].generated_ids
    out["greedy_alone_vs_B1_reference_first_divergence"] = first_divergence(ref_ids, g_ids)
    print("greedy:", out["greedy_alone_vs_B1_reference_first_divergence"], flush=True)
    del dec
    res["correctness"] = out


def _profile(graph) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=70)


def time_variant(model, res: dict, label: str, opts: dict, batches: tuple[int, ...], steps: int,
                 slots: int = 8, mid_image: bool = False, profile: bool = False, save=None) -> None:
    """ms/step of ``batches`` concurrent 1024x1024 requests through one decoder built with ``opts``.

    ``mid_image``: batch 1 again with the slot's cache position (and the decoder's host count) moved
    to mid-image (the floor's KV position), so attention covers what a mid-image step must read.
    """
    t = res.setdefault("timings", {})
    w = h = TIMING_GRID
    capacity = len(PROMPT) + h * (w + 1) + 1
    dec = make_decoder(model, slots, capacity, **opts)
    t0 = time.perf_counter()
    dec.capture()
    t[f"{label}_capture_s"] = time.perf_counter() - t0
    t[f"{label}_graphs"] = len(dec._graphs)  # noqa: SLF001
    t[f"{label}_compiled"] = dec.compile
    t[f"{label}_fused_attention"] = dec.fused_attention
    print(f"[{label}] capture {t[f'{label}_capture_s']:.1f} s, {len(dec._graphs)} graphs, "  # noqa: SLF001
          f"compiled={dec.compile}, fused_attention={dec.fused_attention}", flush=True)
    runs = [(b, False) for b in batches] + ([(1, True)] if mid_image else [])
    for batch, mid in runs:
        seqs = [new_seq(model, w, h, 100 + i) for i in range(batch)]
        for i, s in enumerate(seqs):
            first = dec.reserve(s)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            s.prefill()
            torch.cuda.synchronize()
            if batch == 1 and not mid:
                t[f"{label}_prefill_ms"] = (time.perf_counter() - t0) * 1e3
            dec.activate(i, s, first)
            if mid:  # jump the slot to mid-image: positions (and attention length) of the floor
                jump = len(PROMPT) + 64 * 65 // 2 - len(PROMPT)
                dec.cache_pos[first] += jump
                dec._slots[first].steps_done += jump  # noqa: SLF001
        keyed = {i: s for i, s in enumerate(seqs)}

        def run(n):
            pending = None
            for _ in range(n):
                launched = dec.launch()
                if pending is not None:
                    fed, sampled = dec.collect(pending)
                    for e in pending.entries:
                        keyed[e.key].record_external_step(fed[e.slot], sampled[e.slot])
                        _ = pending.hidden[e.slot : e.slot + 1]
                pending = launched
            fed, sampled = dec.collect(pending)
            for e in pending.entries:
                keyed[e.key].record_external_step(fed[e.slot], sampled[e.slot])

        run(10)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run(steps)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / steps
        shape = dec._shape()  # noqa: SLF001
        graph = dec._graphs[shape][0] if shape in dec._graphs else None  # noqa: SLF001
        replay_ms = [float("nan")] * 3 if graph is None else []
        for _ in range(3 if graph is not None else 0):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(20):
                graph.replay()
            b.record()
            torch.cuda.synchronize()
            replay_ms.append(a.elapsed_time(b) / 20)
        key = f"{label}_B{batch}" + ("_mid" if mid else "")
        pos_end = int(dec.cache_pos[0])
        t[key] = {
            "ms_per_step": ms, "tokens_per_s": batch * 1e3 / ms, "graph_replay_ms": sorted(replay_ms)[1],
            "shape": list(shape), "cache_position_at_end": pos_end,
        }
        print(f"decode [{label}] B={batch}{' mid' if mid else ''}: {t[key]}", flush=True)
        if profile and mid and graph is not None:
            try:
                t[f"profile_{label}_B1_mid"] = _profile(graph)
                print(t[f"profile_{label}_B1_mid"], flush=True)
            except Exception as exc:  # noqa: BLE001
                t["profile_error"] = repr(exc)
        for i in range(batch):
            dec.deactivate(next(st.first for st in dec._slots.values() if st.key == i))  # noqa: SLF001
        if save:
            save()
    del dec
    gc.collect()
    torch.cuda.empty_cache()


def timings(model, res: dict, steps: int, save=None, eager: bool = False) -> None:
    """The default decoder (compiled graphs, fused split-KV attention; buckets) at batch 1, image
    start and mid-image, and 2/4/8 concurrent; at batch 1 the GEMM + softmax attention path and
    padded mode (the engine default); eager graphs (``compile=False``) with ``eager``."""
    time_variant(model, res, "compiled", {}, (1, 2, 4, 8), steps, mid_image=True, profile=True, save=save)
    time_variant(model, res, "compiled_gemm_attention", {"fused_attention": False}, (1,), steps, mid_image=True,
                 save=save)
    time_variant(model, res, "compiled_pad8", {"pad_to_max_bucket": True}, (1,), steps, mid_image=True,
                 save=save)
    if eager:
        time_variant(model, res, "eager", {"compile": False}, (1, 2, 4, 8), steps, mid_image=True, save=save)


def floor_bytes(model: MammothARForCausalLM, position: int) -> dict:
    """Bytes one decode step of one visual token must read (MODEL.md routing, issue-8 definition)."""
    lm = model.language_model
    total = 0
    for layer in lm.layers:
        a = layer.self_attn
        projs = [a.gen_q_proj, a.gen_k_proj, a.gen_v_proj, a.gen_o_proj] if a.has_experts else [
            a.q_proj, a.k_proj, a.v_proj, a.o_proj]
        mlp = layer.gen_mlp if layer.gen_mlp is not None else layer.mlp
        mods = projs + [mlp, layer.input_layernorm, layer.post_attention_layernorm]
        total += sum(p.numel() * p.element_size() for m in mods for p in m.parameters())
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--eager", action="store_true", help="also time eager graphs (compile=False)")
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
    model, _ = random_preview_modules(config, dit=False)
    model.eval().requires_grad_(False)
    def save() -> None:
        (out / "ar_decode.json").write_text(json.dumps(res, indent=2, default=str))

    bw = res["ceilings"]["hbm_bytes_per_s"]
    mid = len(PROMPT) + 64 * 65 // 2
    fb = floor_bytes(model, mid)
    res["floor"] = {**fb, "position": mid, "ms_per_token": fb["total"] / bw * 1e3}
    save()
    for section in (
        lambda: timings(model, res, args.steps, save, eager=args.eager),
        (lambda: correctness(model, res)) if not args.skip_correctness else None,
    ):
        if section is None:
            continue
        try:
            section()
        except Exception:  # noqa: BLE001 - keep the other sections
            res.setdefault("errors", []).append(traceback.format_exc())
            print(traceback.format_exc(), flush=True)
        save()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    if not args.skip_hf:
        try:
            hf_baseline(lc, res)
        except Exception:  # noqa: BLE001
            res["hf_error"] = traceback.format_exc()
            print(res["hf_error"], flush=True)
    (out / "ar_decode.json").write_text(json.dumps(res, indent=2, default=str))

    t = res.get("timings", {})
    floor = res["floor"]["ms_per_token"]
    print("\n| quantity | value |\n| --- | --- |")
    print(f"| copy bandwidth (read+write) | {bw / 1e12:.2f} TB/s |")
    print(f"| bf16 matmul 8192^3 | {res['ceilings']['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s |")
    print(f"| floor per token (B=1, pos {mid}) | {floor:.3f} ms ({res['floor']['total'] / 1e9:.2f} GB) |")
    for key in sorted(k for k in t if isinstance(t[k], dict)):
        v = t[key]
        print(f"| {key} | {v['ms_per_step']:.3f} ms/step ({v['ms_per_step'] / floor:.2f} x floor), "
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
