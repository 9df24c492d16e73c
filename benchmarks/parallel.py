"""Issue 21 on two GPUs, in one call: the stages' own parallel code paths side by side with one GPU.

    PYTHONPATH=. python3 benchmarks/parallel.py --out "$OUT"            # an nvidia-h200-x2 machine
    PYTHONPATH=. python3 benchmarks/parallel.py --tiny --out /tmp/par   # CPU smoke run (gloo, tiny)

Everything runs the code the stages run, from one checkpoint (the MammothModa2-Preview-sized random
checkpoint of `benchmarks/e2e_gpu.py`, written once to ``--ckpt-dir``; ``--tiny``: the built-in tiny one):

1. AR batch-1 ms/token at TP 1 and TP 2: the stage's loader (`load_ar`, shard then move), its engine
   (`stage_ar.server.new_engine`) stepped inline on this process (rank 0, ``cuda:0``), with TP 2 the
   stage's `TensorParallelAR` (rank 1 spawned on ``cuda:1``, a turn header broadcast host to host every turn, two
   NCCL all-reduces per layer captured in the CUDA graphs). One 1024² request (64x64 grid), ``--steps``
   timed steps after 10 warm ones. Target (the issue): TP 2 <= 0.6 x TP 1.
2. DiT ms/step at 1024²: one guided request (both CFG branches), ``--dit-steps`` steps of the
   pipeline's `denoise` after 2 warm ones, single GPU vs `ParallelDiT` ``cfg`` and ``ulysses`` (2 ranks:
   rank 0 here, rank 1 spawned). Target: cfg <= 0.55 x single.
3. End to end 1024²/50 steps through the gateway (`benchmarks/e2e_gpu.start_stages`): AR on GPU 0, DiT
   on GPU 1, one warm-up then ``--requests`` requests one at a time; latency per request.
Results: ``parallel.json`` in --out (rewritten after every section) and one line per number on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _ar_job(bundle, grid: int, key: str):
    from stage_ar.engine import CollectingSink, DecodeJob

    prompt = bundle.tokenizer.encode_t2i_prompt("a lighthouse on a cliff at dusk, benchmark", grid, grid)
    return DecodeJob(request_id=key, epoch=0, prompt_ids=prompt, negative_ids=None, ar_width=grid, ar_height=grid,
                     seed=1, temperature=0.0, top_k=0, top_p=0.0, ar_guidance_scale=0.0, sink=CollectingSink(),
                     on_progress=lambda done, total: None, on_done=lambda exc, stats: None)


def ar_ms_per_token(settings, tp: int, grid: int, steps: int) -> dict[str, Any]:
    """Batch-1 decode ms/token of the AR stage's engine over ``tp`` ranks (this process is rank 0)."""
    from stage_ar.loader import load_ar
    from stage_ar.server import new_engine
    from stage_ar.tensor_parallel_stage import TensorParallelAR

    settings = dataclasses.replace(settings, tensor_parallel_size=tp)
    group = None
    if tp > 1:
        group = TensorParallelAR.start(settings)
        group.join()
        bundle = group.load(settings)
        engine = new_engine(bundle, settings, scheduler_factory=group.scheduler_factory)
        group.ready(engine)
    else:
        bundle = load_ar(settings.checkpoint, settings.cache_dir, settings.resolved_device(),
                         settings.resolved_dtype(), weights_dtype=settings.weights_dtype)
        engine = new_engine(bundle, settings)
    try:
        t0 = time.perf_counter()
        engine.step()  # captures the CUDA graphs (and warms up on CUDA) before anything is submitted
        capture_s = time.perf_counter() - t0
        job = _ar_job(bundle, grid, f"tp{tp}")
        engine.submit(job)
        for _ in range(10):
            engine.step()
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync()
        ms = (time.perf_counter() - t0) * 1e3 / steps
        job.cancel()
        engine.step_until_idle()
        return {"tp": tp, "ms_per_token": ms, "steps": steps, "grid": grid, "capture_s": capture_s,
                "cuda_graphs": engine.runner.graphs_captured}
    finally:
        if group is not None:
            group.stop(engine)
        del engine, bundle
        _free()


def dit_ms_per_step(settings, mode: str, size: int, steps: int) -> dict[str, Any]:
    """ms per guided denoising step at ``size``² of the DiT stage's pipeline, ``mode`` none|cfg|ulysses."""
    from stage_dit.loader import load_pipeline
    from stage_dit.parallel_stage import ParallelDiT

    settings = dataclasses.replace(settings, dit_parallel=mode)
    parallel = None
    if mode != "none":
        parallel = ParallelDiT.start(settings)
        parallel.join()
        pipe = parallel.load()
        parallel.ready()
    else:
        pipe = load_pipeline(settings)
    try:
        g = torch.Generator().manual_seed(0)
        cond = torch.randn(128, pipe.llm_hidden_size, generator=g).to(pipe.device, pipe.dtype)
        latents = pipe.prepare_latents(width=size, height=size, seed=0)
        with torch.inference_mode():
            pipe.denoise(latents, cond, None, num_inference_steps=2, text_guidance_scale=4.0)
            _sync()
            t0 = time.perf_counter()
            pipe.denoise(latents, cond, None, num_inference_steps=steps, text_guidance_scale=4.0)
            _sync()
        return {"mode": mode, "size": size, "ms_per_step": (time.perf_counter() - t0) * 1e3 / steps, "steps": steps}
    finally:
        if parallel is not None:
            parallel.stop()
        del pipe
        _free()


def end_to_end(checkpoint: str, size: int, steps: int, requests: int, gpus: bool, workdir: pathlib.Path) -> dict:
    """Latency of ``size``²/``steps`` requests through the gateway, AR on GPU 0 and DiT on GPU 1."""
    import httpx

    from benchmarks.e2e_gpu import start_stages
    from mammoth_app.local import stop_pipeline

    args = argparse.Namespace(checkpoint=checkpoint, ar_gpu="0" if gpus else None, dit_gpu="1" if gpus else None,
                              dit_slots=2, ar_slots=2, ready_timeout=1800)
    comps = start_stages(args, workdir, None)
    try:
        url = f"http://{comps[-1].address}/v1/images/generations"
        body = {"prompt": "a lighthouse on a cliff at dusk", "size": f"{size}x{size}", "num_inference_steps": steps,
                "seed": 3}
        latencies = []
        for i in range(requests + 1):
            t0 = time.perf_counter()
            r = httpx.post(url, json=body, timeout=1800)
            r.raise_for_status()
            if i:  # the first is the warm-up
                latencies.append((time.perf_counter() - t0) * 1e3)
        return {"size": size, "steps": steps, "latency_ms": latencies, "median_ms": statistics.median(latencies),
                "ar_gpu": args.ar_gpu, "dit_gpu": args.dit_gpu}
    finally:
        stop_pipeline(comps)


def _checkpoint(args) -> str:
    if args.tiny:
        from mammoth_app.make_checkpoint import materialize_checkpoint

        return str(materialize_checkpoint("builtin://tiny", args.cache_dir))
    from benchmarks.e2e_gpu import build_preview_checkpoint

    folder = pathlib.Path(args.ckpt_dir)
    build_preview_checkpoint(folder)
    return str(folder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny checkpoint, gloo, small sizes")
    parser.add_argument("--ckpt-dir", default="/tmp/mammoth-preview-ckpt")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--steps", type=int, default=200, help="timed AR decode steps")
    parser.add_argument("--dit-steps", type=int, default=10, help="timed DiT steps")
    parser.add_argument("--requests", type=int, default=3, help="end-to-end requests after the warm-up")
    parser.add_argument("--sections", default="ar,dit,e2e")
    args = parser.parse_args()
    from mammoth_core.settings import ARSettings, DiTSettings

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="mammoth-par-cache-")
    gpus = not args.tiny
    device = "cuda" if gpus else "cpu"
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "torch": torch.__version__,
                           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                           "tiny": args.tiny, "command": " ".join(sys.argv)}
    ckpt = _checkpoint(args)
    common = {"checkpoint": ckpt, "cache_dir": args.cache_dir, "device": device, "log_level": "warning",
              "distributed_timeout_seconds": 300.0}
    size, grid, dit_steps, e2e_steps = (1024, 64, args.dit_steps, 50) if gpus else (128, 8, 2, 2)
    sections = set(args.sections.split(","))

    def save() -> None:
        (out / "parallel.json").write_text(json.dumps(res, indent=2, default=str))

    if "ar" in sections:
        ar = ARSettings(**common, max_running_sequences=2)
        for tp in (1, 2):
            res[f"ar_tp{tp}"] = r = ar_ms_per_token(ar, tp, grid, args.steps if gpus else 5)
            print(f"AR TP{tp} B1: {r['ms_per_token']:.3f} ms/token ({r['cuda_graphs']} graphs)", flush=True)
            save()
        res["ar_tp2_over_tp1"] = res["ar_tp2"]["ms_per_token"] / res["ar_tp1"]["ms_per_token"]
        print(f"AR TP2 / TP1 = {res['ar_tp2_over_tp1']:.3f} (target <= 0.6)", flush=True)
    if "dit" in sections:
        dit = DiTSettings(**common, dit_parallel_size=2)
        for mode in ("none", "cfg", "ulysses"):
            res[f"dit_{mode}"] = r = dit_ms_per_step(dit, mode, size, dit_steps)
            print(f"DiT {mode} {size}^2: {r['ms_per_step']:.2f} ms/step", flush=True)
            save()
        for mode in ("cfg", "ulysses"):
            res[f"dit_{mode}_over_single"] = res[f"dit_{mode}"]["ms_per_step"] / res["dit_none"]["ms_per_step"]
        print(f"DiT cfg / single = {res['dit_cfg_over_single']:.3f} (target <= 0.55), "
              f"ulysses / single = {res['dit_ulysses_over_single']:.3f}", flush=True)
    save()
    if "e2e" in sections:
        res["end_to_end"] = r = end_to_end(ckpt, size, e2e_steps, args.requests if gpus else 1, gpus,
                                           pathlib.Path(tempfile.mkdtemp(prefix="mammoth-par-e2e-")))
        print(f"end to end {size}^2/{e2e_steps}: median {r['median_ms']:.0f} ms ({r['latency_ms']})", flush=True)
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
