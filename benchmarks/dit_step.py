"""DiT step time at MammothModa2-Preview dimensions on a GPU: ms/step with CFG, FLOP floor, VAE
decode, whole-image time ("DiT alone") and the top kernels of one step.

Run on the GPU machine from the source tree (no checkpoint needed: random bf16 weights):

    PYTHONPATH=. python3 benchmarks/dit_step.py --out "$OUT"

One step = one `stage_dit.denoise.denoise_step` (CUDA-graph replay, as served) of one request with both CFG branches batched (the positive
condition of 128 refined rows, the unconditional branch empty, as the served path with no negative
prompt) + the Euler update, timed with CUDA events after warm-up. The FLOP floor counts
`2 x parameters x tokens` for the linear layers plus `4 x tokens^2 x hidden` per attention layer
(condition + image tokens, both branches), divided by the measured bf16 matmul rate (8192^3).
"DiT alone" = `prepare_latents` + `denoise` + `decode_latents` of one image (wall clock, synchronised),
the in-process reference for the end-to-end comparison (`benchmarks/e2e_gpu.py`).
Results: a table on stdout and `dit_step.json` in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.full_size import ceilings, count, peak_gib, random_preview_dit_pipeline, reset_peak, timed_cuda  # noqa: E402
from mammoth_app.make_checkpoint import preview_config  # noqa: E402


def flop_floor(n_params: int, tokens: int, hidden: int, attn_layers: int, branches: int = 2) -> float:
    """FLOPs of one step: `branches x (2 n_params tokens + 4 tokens^2 hidden attn_layers)`."""
    return branches * (2 * n_params * tokens + 4 * tokens**2 * hidden * attn_layers)


def top_kernels(step, n: int = 15) -> tuple[list[dict], float]:
    """Kernel table of one step under `torch.profiler`: the `n` longest kernels (name, total ms, calls,
    share) and the summed kernel time in ms."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = []
    total = 0.0
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "self_cuda_time_total", 0.0)
        if dev_us <= 0 or e.key.startswith(("aten::", "cuda")):
            continue
        rows.append({"kernel": e.key[:110], "ms": dev_us / 1e3, "calls": e.count})
        total += dev_us / 1e3
    rows.sort(key=lambda r: -r["ms"])
    for r in rows:
        r["share"] = r["ms"] / total if total else 0.0
    return rows[:n], total


@torch.inference_mode()
def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sizes", default="512:20,1024:50", help="SIZE:STEPS list")
    parser.add_argument("--repeat", type=int, default=10, help="timed steps per size")
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "command": "PYTHONPATH=. python3 benchmarks/dit_step.py --out $OUT",
    }
    res["ceilings"] = ceilings()
    flops_rate = res["ceilings"]["bf16_flops_per_s"]
    print(f"GPU {res['gpu']}, torch {res['torch']}, bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s", flush=True)

    from stage_dit.denoise import DenoiseState, ImageRequest, denoise_step

    config, _ = preview_config()
    pipe = random_preview_dit_pipeline(config)
    dc = config["gen_dit_config"]
    n_dit = count(pipe.transformer)
    hidden_llm = config["llm_config"]["hidden_size"]
    cond = torch.randn(128, hidden_llm, device="cuda", dtype=torch.bfloat16)
    res["dit_params"] = n_dit
    res["sizes"] = {}
    for spec in args.sizes.split(","):
        size, steps = (int(x) for x in spec.split(":"))
        reset_peak()
        latents = pipe.prepare_latents(width=size, height=size, seed=0)

        def step() -> None:  # one guided step of one request, as the worker loop runs it
            state = DenoiseState(pipe, ImageRequest(cond, None, size, size, steps, 4.0), latents)
            denoise_step(pipe.transformer, [state], pipe.step_graphs)

        step_ms = timed_cuda(step, repeat=args.repeat, warmup=2)
        tokens = (size // 16) ** 2 + cond.shape[0]
        floor_ms = flop_floor(n_dit, tokens, dc["hidden_size"], dc["num_layers"] + dc["num_refiner_layers"]) / flops_rate * 1e3
        lat = torch.randn(1, 16, size // 8, size // 8, device="cuda")
        vae_ms = timed_cuda(lambda: pipe.decode_latents(lat), repeat=3)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pipe.generate(cond, None, width=size, height=size, num_inference_steps=steps, text_guidance_scale=9.0, seed=1)
        torch.cuda.synchronize()
        alone_s = time.perf_counter() - t0
        entry = {
            "steps": steps,
            "tokens_per_branch": tokens,
            "ms_per_step": step_ms,
            "floor_ms_per_step": floor_ms,
            "ratio_to_floor": step_ms / floor_ms,
            "vae_decode_ms": vae_ms,
            "dit_alone_s": alone_s,
            "peak_gib": peak_gib(),
        }
        if not args.no_profile:
            kernels, kernel_ms = top_kernels(step)
            entry["profile_kernel_ms"] = kernel_ms
            entry["top_kernels"] = kernels
        res["sizes"][str(size)] = entry
        print(
            f"DiT {size}^2: {step_ms:.1f} ms/step (floor {floor_ms:.1f} ms, {step_ms / floor_ms:.2f}x), "
            f"VAE {vae_ms:.1f} ms, {steps} steps + VAE alone {alone_s:.2f} s, peak {entry['peak_gib']:.1f} GiB",
            flush=True,
        )
        for k in entry.get("top_kernels", [])[:10]:
            print(f"    {k['ms']:8.2f} ms {k['calls']:5d}x {100 * k['share']:5.1f}%  {k['kernel']}", flush=True)
        (out / "dit_step.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
