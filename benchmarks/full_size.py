"""Full-size (MammothModa2-Preview dimensions) build, checkpoint round trip and first timings on a GPU.

Run on the GPU machine from the source tree (no install):

    PYTHONPATH=. python benchmarks/full_size.py --out "$OUT"

Steps, each timed, peak GPU memory recorded:
1. ceilings: device-to-device copy bandwidth (bytes read + written) and a large bf16 matmul;
2. the AR and the DiT modules built from `preview_config()` in bf16 with random weights on the GPU
   (parameter counts per component);
3. the weights written as a real sharded checkpoint, validated by `check_checkpoint` (headers
   only) and loaded back through the stages' loaders (`stage_ar.loader.load_ar`,
   `stage_dit.loader.load_pipeline`): load time and peak memory per stage;
4. AR: prefill + decode ms/token at batch 1 with the simple engine path (`T2ISequence`), and the
   per-token HBM floor; Hugging Face `transformers` `Qwen2ForCausalLM.generate` at the same
   dimensions as the baseline;
5. DiT: ms/step at 512² and 1024² with CFG (both branches batched), FLOP floor, VAE decode time.
Results: a table on stdout and `full_size.json` in --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mammoth_app.make_checkpoint import preview_config, save_sharded  # noqa: E402

GiB = 1024**3


def timed_cuda(fn, repeat: int = 5, warmup: int = 1) -> float:
    """Median milliseconds of ``fn()`` timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def ceilings() -> dict:
    n = 2 * GiB // 2  # 2 GiB of bf16
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = timed_cuda(lambda: y.copy_(x), repeat=10)
    bw = 2 * x.numel() * 2 / (ms / 1e3)
    del x, y
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms_mm = timed_cuda(lambda: a @ b, repeat=10)
    flops = 2 * m**3 / (ms_mm / 1e3)
    del a, b
    return {"hbm_bytes_per_s": bw, "bf16_flops_per_s": flops}


@torch.no_grad()
def random_init_(module: torch.nn.Module, seed: int) -> None:
    """Norm scales 1, biases 0, matrices N(0, 1/fan_in) (activations stay in range)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    for name, p in module.named_parameters():
        if p.ndim == 1:
            p.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            fan_in = p[0].numel()
            p.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=g)


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def random_preview_modules(config: dict, dit: bool = True):
    """The AR (``MammothARForCausalLM``) and, with ``dit``, the DiT modules (`build_dit_modules`)
    built on CUDA in bf16 from ``config`` (a MammothModa2 ``config.json`` dict), weights from
    `random_init_` (seed 1 for the AR, 2 + i for the i-th DiT module). Returns ``(ar, dit or None)``."""
    from stage_ar.modeling_mammoth_ar import MammothARForCausalLM
    from stage_dit.pipeline import build_dit_modules

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            ar = MammothARForCausalLM.from_llm_config(config["llm_config"])
        modules = build_dit_modules(config, device="cuda", dtype=torch.bfloat16) if dit else None
    finally:
        torch.set_default_dtype(torch.float32)
    random_init_(ar, 1)
    if modules is not None:
        for i, m in enumerate(modules.named_modules_by_prefix().values()):
            random_init_(m, 2 + i)
    return ar, modules


def random_preview_dit_pipeline(config: dict):
    """A `MammothDiTPipeline` on CUDA in bf16 from ``config`` (a MammothModa2 ``config.json`` dict),
    weights from `random_init_` (seed 2 + i for the i-th DiT module, as `random_preview_modules`)."""
    from stage_dit.pipeline import MammothDiTPipeline, build_dit_modules

    torch.set_default_dtype(torch.bfloat16)
    try:
        dit = build_dit_modules(config, device="cuda", dtype=torch.bfloat16)
    finally:
        torch.set_default_dtype(torch.float32)
    for i, m in enumerate(dit.named_modules_by_prefix().values()):
        random_init_(m, 2 + i)
    return MammothDiTPipeline(dit, config, device="cuda", dtype=torch.bfloat16)


def hf_generate_ms_per_token(lc: dict, prompt: list[int], n_new: int, init_seed: int | None = None) -> float:
    """ms/token of Hugging Face ``Qwen2ForCausalLM.generate`` (eager, greedy, batch 1) at the AR's
    dimensions (``lc``: the ``llm_config``), bf16 on CUDA: one 8-token warm-up, then ``n_new``
    tokens after ``prompt``. Weights: `random_init_` with ``init_seed``, or the model's own init."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qc = Qwen2Config(
        vocab_size=lc["vocab_size"] + lc["gen_vocab_size"], hidden_size=lc["hidden_size"],
        intermediate_size=lc["intermediate_size"], num_hidden_layers=lc["num_hidden_layers"],
        num_attention_heads=lc["num_attention_heads"], num_key_value_heads=lc["num_key_value_heads"],
        max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False,
    )
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            hf = Qwen2ForCausalLM(qc)
    finally:
        torch.set_default_dtype(torch.float32)
    if init_seed is not None:
        random_init_(hf, init_seed)
    hf.eval()
    ids = torch.tensor([prompt], device="cuda")
    hf.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / n_new
    del hf
    return ms


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / GiB


def reset_peak() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--ckpt-dir", default="/tmp/mammoth-preview")
    parser.add_argument("--decode-steps", type=int, default=200)
    parser.add_argument("--skip-save", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    print(f"GPU {res['gpu']}, torch {res['torch']}", flush=True)
    res["ceilings"] = ceilings()
    print("ceilings", res["ceilings"], flush=True)

    from stage_ar.modeling_mammoth_ar import MammothARForCausalLM

    config, generation = preview_config()
    ckpt = pathlib.Path(args.ckpt_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    # 2. build with random weights
    reset_peak()
    t0 = time.perf_counter()
    ar, dit = random_preview_modules(config)
    torch.cuda.synchronize()
    res["build_s"] = time.perf_counter() - t0
    res["params"] = {"llm_model": count(ar), **{k: count(m) for k, m in dit.named_modules_by_prefix().items()}}
    res["build_peak_gib"] = peak_gib()
    print("params", res["params"], f"build {res['build_s']:.1f}s peak {res['build_peak_gib']:.1f} GiB", flush=True)

    # 3. checkpoint round trip
    if not args.skip_save:
        t0 = time.perf_counter()
        state = {f"llm_model.{k}": v.cpu() for k, v in ar.state_dict().items()}
        for prefix, m in dit.named_modules_by_prefix().items():
            state.update({f"{prefix}.{k}": v.cpu() for k, v in m.state_dict().items()})
        del ar, dit
        reset_peak()
        save_sharded(state, ckpt, shard_bytes=5 * GiB)
        del state
        gc.collect()
        (ckpt / "config.json").write_text(json.dumps(config, indent=2))
        (ckpt / "t2i_generation_config.json").write_text(json.dumps(generation, indent=2))
        res["save_s"] = time.perf_counter() - t0
        print(f"saved in {res['save_s']:.1f}s", flush=True)
        from mammoth_app.check_checkpoint import check_checkpoint

        report = check_checkpoint(ckpt)
        res["check_checkpoint"] = {
            "seconds": report.seconds, "tensors": report.tensors_checked,
            "parameters": report.parameters, "problems": report.problems,
        }
        print(report.render().splitlines()[0], f"({report.seconds:.2f}s)", flush=True)
        from stage_ar.loader import ARBundle
        from mammoth_core.checkpoint import Checkpoint

        reset_peak()
        t0 = time.perf_counter()
        handle = Checkpoint(ckpt)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            ar = MammothARForCausalLM.from_llm_config(handle.llm_config)
        torch.set_default_dtype(torch.float32)
        handle.load_module(ar, "llm_model.", device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        res["ar_load_s"] = time.perf_counter() - t0
        res["ar_load_peak_gib"] = peak_gib()
        from mammoth_core.settings import DiTSettings
        from stage_dit.loader import load_pipeline

        t0 = time.perf_counter()
        pipe = load_pipeline(DiTSettings(checkpoint=str(ckpt), device="cuda", dtype="bfloat16"))
        torch.cuda.synchronize()
        res["dit_load_s"] = time.perf_counter() - t0
        print(f"load AR {res['ar_load_s']:.1f}s DiT {res['dit_load_s']:.1f}s", flush=True)
    else:
        from stage_dit.pipeline import MammothDiTPipeline

        pipe = MammothDiTPipeline(dit, config, device="cuda", dtype=torch.bfloat16)
    ar.eval()

    # 4. AR decode (simple engine path)
    from stage_ar.generation import T2ISequence
    from stage_ar.sampling import GridConstrainedSampler

    reset_peak()
    gen = torch.Generator().manual_seed(0)
    prompt = [151644] + list(range(1000, 1060)) + [151645, 152069]
    sampler = GridConstrainedSampler(64, 64, 152064, 152072, 152072 + 16384, 1.0, None, 1.0, gen)
    seq = T2ISequence(ar, prompt, 64, 64, sampler)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    seq.prefill()
    torch.cuda.synchronize()
    res["ar_prefill_ms"] = (time.perf_counter() - t0) * 1e3
    for _ in range(5):
        seq.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.decode_steps):
        seq.step()
    torch.cuda.synchronize()
    res["ar_ms_per_token"] = (time.perf_counter() - t0) * 1e3 / args.decode_steps
    res["ar_decode_peak_gib"] = peak_gib()
    seq.release()
    lc = config["llm_config"]
    h, inter, layers = lc["hidden_size"], lc["intermediate_size"], lc["num_hidden_layers"]
    kv = lc["num_key_value_heads"] * (h // lc["num_attention_heads"])
    per_layer = 2 * (h * h + 2 * h * kv + 2 * kv + h + h * h + 3 * h * inter + 2 * h)  # bf16 bytes
    head_rows = 16384 + 1  # the grid constraint allows visual codes + EOL only
    pos = len(prompt) + 2080  # mid-image for a 64x64 grid
    kv_bytes = layers * 2 * pos * kv * 2
    floor_bytes = layers * per_layer + 2 * h + head_rows * h * 2 + kv_bytes
    res["ar_floor_ms_per_token"] = floor_bytes / res["ceilings"]["hbm_bytes_per_s"] * 1e3
    print(
        f"AR prefill {res['ar_prefill_ms']:.1f} ms, decode {res['ar_ms_per_token']:.2f} ms/token "
        f"(floor {res['ar_floor_ms_per_token']:.2f} ms), peak {res['ar_decode_peak_gib']:.1f} GiB",
        flush=True,
    )
    del ar, seq
    reset_peak()

    # 5. DiT
    res["dit"] = {}
    cond = torch.randn(128, h, device="cuda", dtype=torch.bfloat16)
    dc = config["gen_dit_config"]
    n_dit = count(pipe.transformer)
    for size in (512, 1024):
        stamps = []
        steps = 6

        def cb(i, total, latents):
            torch.cuda.synchronize()
            stamps.append(time.perf_counter())

        reset_peak()
        t0 = time.perf_counter()
        pipe.generate(cond, None, width=size, height=size, num_inference_steps=steps,
                      text_guidance_scale=4.0, seed=0, callback=cb)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        step_ms = (stamps[-1] - stamps[1]) / (len(stamps) - 2) * 1e3
        tokens = (size // 16) ** 2 + 128
        flops = 2 * (2 * n_dit * tokens + 4 * tokens**2 * dc["hidden_size"] * (dc["num_layers"] + dc["num_refiner_layers"]))
        lat = torch.randn(1, 16, size // 8, size // 8, device="cuda")
        vae_ms = timed_cuda(lambda: pipe.decode_latents(lat), repeat=3)
        res["dit"][size] = {
            "ms_per_step": step_ms,
            "floor_ms_per_step": flops / res["ceilings"]["bf16_flops_per_s"] * 1e3,
            "vae_ms": vae_ms,
            "peak_gib": peak_gib(),
            "total_s_6_steps": total,
        }
        print(f"DiT {size}: {res['dit'][size]}", flush=True)
    del pipe
    reset_peak()

    # HF baseline
    if not args.skip_hf:
        try:
            res["hf_ms_per_token"] = hf_generate_ms_per_token(lc, prompt, 128)
            print(f"HF transformers generate: {res['hf_ms_per_token']:.2f} ms/token", flush=True)
        except Exception as exc:  # noqa: BLE001
            res["hf_error"] = repr(exc)
            print("HF baseline failed:", exc, flush=True)

    (out / "full_size.json").write_text(json.dumps(res, indent=2, default=str))
    print(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
