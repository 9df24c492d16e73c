"""Speculative Jacobi decoding (issue 18) on a GPU at MammothModa2-Preview dimensions.

Run on the GPU machine from the source tree (no install, no checkpoint: random bf16 weights), in
about two minutes on one H200:

    PYTHONPATH=. python benchmarks/jacobi.py --out "$OUT"

On CPU, as a smoke test (a 2-layer model of width 64 with the Preview vocabulary, float32):

    PYTHONPATH=. python benchmarks/jacobi.py --tiny --out /tmp/jacobi

Sections (``jacobi.json`` in --out, a table on stdout):
1. ``window_cost``: one verification forward (`stage_ar.window_forward.WindowForward`, the path
   the engine runs: the model's one forward with the split-KV Triton window kernel, logits of the
   visual codes of every window position) at a mid-image KV position over the whole pool width,
   window ``T`` in 1 .. 32, batch 1 and 8: ms (CUDA events, median of 10), replayed as a CUDA graph
   (``graph``) and run eagerly (``eager``);
2. ``decode``: one grid (24x24 by default) through the AR stage's `DecodeEngine` driven inline:
   ``sequential`` (the runner's CUDA-graph step) and ``jacobi`` (window 16) for the random model as
   it is and for *sharpened* models ``s:c``: the generation head's weights multiplied by ``s``
   (logits x s, i.e. sampling at temperature ``1/s``) and every visual code's input embedding pulled
   to their mean, ``mean + c * (e - mean)`` (the next-token distribution then depends on the fed
   code ``c`` times as much). Random weights give nearly uniform distributions over 16,384 codes, on
   which almost every draft is accepted (``p(x) / q(x)`` is about 1 for any two near-uniform
   distributions): an optimistic figure; a head scale alone gives peaked distributions that change
   completely with the previous code (few drafts accepted); a trained model's are peaked and locally
   smooth, which the two knobs together imitate. Per model: forwards per token, ms per token, ms
   per Jacobi turn (the forward plus targets, accept/resample, drafts and the read-back), the mean
   probability of the most likely code; then a window sweep (``--sweep``) on one sharpened model;
3. ``estimate_1024``: the 1024x1024 end-to-end latency (4,160 grid tokens) at the acceptance rates
   the papers report (2, 3 and 5 tokens per forward: SJD's ~2x step compression on Lumina-mGPT,
   SJD++'s 2-7x), ``AR = grid tokens / rate x one Jacobi turn at window 16, batch 1`` (measured in
   ``decode``; ``forward_only``: the forward alone) plus the DiT alone at 1024x1024/50 steps (``--dit-s``, 5.28 s measured in docs/PERFORMANCE.md). These are
   estimates: real acceptance needs real weights.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mammoth_core.decoding import ARDecoding, DecodingOptions  # noqa: E402
from mammoth_app.make_checkpoint import preview_config  # noqa: E402
from stage_ar import decode_attention  # noqa: E402
from stage_ar.engine import CollectingSink, DecodeEngine, DecodeJob  # noqa: E402
from stage_ar.generation import T2ISequence  # noqa: E402
from stage_ar.kv_pool import KVPool  # noqa: E402
from stage_ar.modeling_mammoth_ar import MammothARForCausalLM  # noqa: E402
from stage_ar.sampling import GridConstrainedSampler  # noqa: E402
from stage_ar.window_forward import WindowForward  # noqa: E402

EOL, VSTART, VEND = 152064, 152072, 152072 + 16384
PROMPT = [151644] + list(range(1000, 1060)) + [151645, 152069]
WINDOWS = (1, 2, 4, 8, 12, 16, 20, 24, 32)
PAPER_RATES = (2.0, 3.0, 5.0)


def build(tiny: bool) -> tuple[MammothARForCausalLM, torch.device]:
    """The AR at Preview dimensions (bf16, CUDA) or, with ``tiny``, shrunk (float32, CPU); random
    weights: norm scales 1, biases 0, matrices N(0, 1/fan_in)."""
    llm = dict(preview_config()[0]["llm_config"])
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if tiny:
        llm.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, moe_type="ffn_attention-1:2")
    with torch.device(device):
        model = MammothARForCausalLM.from_llm_config(llm).to(dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()), generator=gen)
    return model.eval().requires_grad_(False), device


def timed(fn, device: torch.device, iters: int = 10) -> float:
    """Median ms of ``fn()`` over ``iters`` runs after 3 warm-ups (CUDA events on CUDA)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def window_cost(model, device, position: int, windows=WINDOWS, batches=(1, 8)) -> dict:
    """ms of one verification forward (+ visual logits) per (batch, window) at KV ``position``:
    ``{"graph": {...}, "eager": {...}}`` keyed ``b{batch}_t{T}`` (``graph`` only on CUDA)."""
    cfg = model.config
    fused = decode_attention.available(device)
    out: dict = {"graph": {}, "eager": {}, "attention": "triton" if fused else "gemm"}
    for batch in batches:
        pool = KVPool(cfg, batch, position + max(windows), device=device, dtype=model.lm_head.weight.dtype)
        meta = [list(range(batch)), [position] * batch, [position] * batch, [0] * batch]
        for mode in ("graph", "eager") if device.type == "cuda" else ("eager",):
            forward = WindowForward(model, pool.key, pool.value, VSTART, VEND, cfg.head_dim**-0.5,
                                    fused_attention=fused, cuda_graphs=mode == "graph")
            for t in windows:
                ids = torch.full((batch, t), VSTART + 7, device=device, dtype=torch.long)
                ms = round(timed(lambda: forward(meta, ids, pool.capacity), device), 3)
                out[mode][f"b{batch}_t{t}"] = ms
                print(f"window cost {mode} batch {batch} T {t}: {ms} ms", flush=True)
            forward.release()
        del pool
    return out


def make_engine(model, grid: int) -> DecodeEngine:
    def make(job: DecodeJob) -> T2ISequence:
        sampler = GridConstrainedSampler(job.ar_width, job.ar_height, EOL, VSTART, VEND, 1.0, None, 1.0,
                                         torch.Generator().manual_seed(job.seed))
        return T2ISequence(model, job.prompt_ids, job.ar_width, job.ar_height, sampler, decoding=job.decoding)
    capacity = len(PROMPT) + grid * (grid + 1) + 16
    return DecodeEngine(make, 1, model=model, grid_ids=(EOL, VSTART, VEND), max_sequence_length=capacity,
                        batch_invariant=False, kv_slots=1, decoder_options={"buckets": (1,)})


def decode_run(engine: DecodeEngine, grid: int, decoding: DecodingOptions, device) -> dict:
    """One grid through the engine: ms/token and forwards/token of the decode (prefill excluded)."""
    stats = {}
    job = DecodeJob("bench", 0, list(PROMPT), None, grid, grid, 0, 0, 0, 0, 0.0, CollectingSink(),
                    lambda a, b: None, lambda exc, s: stats.update(s=s), decoding=decoding)
    jacobi = engine.runner.jacobi
    f0, steps0 = jacobi.forwards, engine.runner.steps_launched
    if device.type == "cuda":
        torch.cuda.synchronize()
    engine.run_job(job)
    tokens = grid * (grid + 1)
    forwards = (jacobi.forwards - f0) + (engine.runner.steps_launched - steps0)
    return {"ms_per_token": round(stats["s"].decode_ms / tokens, 3), "forwards_per_token": round(forwards / tokens, 4),
            "ms_per_forward": round(stats["s"].decode_ms / max(forwards, 1), 3),
            "decode_s": round(stats["s"].decode_ms / 1e3, 2)}


@torch.no_grad()
def sharpen(model, head: torch.Tensor, embed: torch.Tensor, scale: float, context: float) -> None:
    """Set the generation head to ``scale x head`` and the visual codes' embeddings to
    ``mean + context x (embed - mean)`` (``head``, ``embed``: the original weights)."""
    model.gen_head.weight.copy_(head * scale)
    codes = slice(VSTART - EOL, VEND - EOL)
    table = model.language_model.gen_embed_tokens.weight
    mean = embed[codes].mean(0, keepdim=True)
    table[codes] = mean + context * (embed[codes] - mean)


@torch.inference_mode()
def peak_probability(model, device, scale: float) -> float:
    """Mean over a few positions of the most likely code's probability (temperature 1)."""
    ids = torch.tensor([PROMPT + [VSTART + i * 37 % 16384 for i in range(32)]], device=device)
    h = model(ids, torch.arange(ids.shape[1], device=device)[None], compute_logits=False).last_hidden_state[0, -16:]
    probs = torch.softmax(model.compute_logits(h, VSTART, VEND) * scale, -1)
    return round(float(probs.max(-1).values.mean()), 4)


def decode_section(model, device, grid: int, window: int, models: list[tuple[float, float]],
                   sweep: list[int], sweep_model: tuple[float, float]) -> dict:
    """Sequential, then Jacobi (plain, and with SJD++ spatial init + token reuse) per model ``(s, c)``,
    then Jacobi with spatial init + reuse at each window of ``sweep`` on ``sweep_model``. One
    untimed Jacobi run first (compilation, CUDA-graph capture of the window forward)."""
    engine = make_engine(model, grid)
    out = {"grid": grid, "window": window, "sequential": decode_run(engine, grid, DecodingOptions(), device)}
    print("sequential:", out["sequential"], flush=True)
    decode_run(engine, grid, DecodingOptions(ARDecoding.JACOBI, window), device)  # warm-up
    head = model.gen_head.weight.clone()
    embed = model.language_model.gen_embed_tokens.weight.clone()
    for s, c in models:
        sharpen(model, head, embed, s, c)
        for label, options in (("jacobi", DecodingOptions(ARDecoding.JACOBI, window)),
                               ("jacobi_spatial_reuse", DecodingOptions(ARDecoding.JACOBI, window, True, True))):
            run = decode_run(engine, grid, options, device)
            run["peak_probability"] = peak_probability(model, device, 1.0)
            out[f"{label}_s{s:g}_c{c:g}"] = run
            print(f"{label} s={s:g} c={c:g}:", run, flush=True)
    s, c = sweep_model
    sharpen(model, head, embed, s, c)
    for w in sweep:
        options = DecodingOptions(ARDecoding.JACOBI, w, True, True)
        decode_run(engine, grid, options, device)  # capture this window's shapes
        out[f"sweep_s{s:g}_c{c:g}_w{w}"] = run = decode_run(engine, grid, options, device)
        print(f"sweep s={s:g} c={c:g} window {w}:", run, flush=True)
    sharpen(model, head, embed, 1.0, 1.0)
    return out


def estimate(cost: dict, decode: dict, dit_s: float, window: int) -> dict:
    """1024x1024 end-to-end seconds: sequential, and Jacobi at `PAPER_RATES` tokens per forward with
    the measured mean Jacobi turn at ``window`` (and with the forward alone, ``forward_only``)."""
    tokens = 64 * 65
    table = cost.get("graph") or cost["eager"]
    fwd = table.get(f"b1_t{window}", table.get("b1_t16"))
    turns = [v["ms_per_forward"] for k, v in decode.items() if k.startswith("jacobi")]
    turn = statistics.mean(turns)
    out = {"sequential_s": round(tokens * decode["sequential"]["ms_per_token"] / 1e3 + dit_s, 2),
           "turn_ms": round(turn, 3), "forward_ms": fwd}
    for rate in PAPER_RATES:
        out[f"jacobi_{rate:g}_tokens_per_forward_s"] = round(tokens / rate * turn / 1e3 + dit_s, 2)
        out[f"forward_only_{rate:g}_tokens_per_forward_s"] = round(tokens / rate * fwd / 1e3 + dit_s, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/jacobi")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: a tiny model, a 3x3 grid, "
                        "windows 1 and 16 at batch 1 and 2")
    parser.add_argument("--grid", type=int, default=0, help="decode grid side (default 24; 3 with --tiny)")
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--models", default="",
                        help="sharpened models s:c (head scale : context sensitivity), comma-separated "
                        "(default 1:1,16:1,16:0.01,16:0; 1:1,16:0 with --tiny)")
    parser.add_argument("--sweep", default="", help="windows of the sweep, comma-separated (default "
                        "4,8,16,24,32; 2,4 with --tiny), Jacobi + spatial init + reuse on --sweep-model")
    parser.add_argument("--sweep-model", default="16:0.01")
    parser.add_argument("--windows", default="", help="window lengths of window_cost (default 1..32)")
    parser.add_argument("--dit-s", type=float, default=5.28, help="DiT alone at 1024x1024/50 steps, seconds")
    args = parser.parse_args()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, device = build(args.tiny)
    res: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "tiny": args.tiny}
    position = 64 if args.tiny else len(PROMPT) + 64 * 65 // 2
    windows = tuple(int(w) for w in args.windows.split(",")) if args.windows else WINDOWS
    res["window_cost_ms"] = window_cost(model, device, position, *(((1, 16), (1, 2)) if args.tiny else (windows,)))
    grid = args.grid or (3 if args.tiny else 24)
    spec = args.models or ("1:1,16:0" if args.tiny else "1:1,16:1,16:0.01,16:0")
    models = [tuple(float(v) for v in m.split(":")) for m in spec.split(",")]
    sweep = [int(w) for w in (args.sweep or ("2,4" if args.tiny else "4,8,16,24,32")).split(",")]
    sweep_model = tuple(float(v) for v in args.sweep_model.split(":"))
    res["decode"] = decode_section(model, device, grid, args.window, models, sweep, sweep_model)
    res["estimate_1024"] = estimate(res["window_cost_ms"], res["decode"], args.dit_s, args.window)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    (out_dir / "jacobi.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
