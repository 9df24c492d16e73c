"""DiT cross-request batching, side by side with an older tree: ms/step, images/min, latency, memory.

Run on one GPU from the source tree (random Preview-size bf16 DiT weights, no checkpoint):

    PYTHONPATH=. python3 benchmarks/dit_batching.py --old-tree /tmp/old --out $OUT/dit_batching.json

Each tree (``--old-tree DIR`` and this one) is measured in its own subprocess that imports
``stage_dit`` from that tree only. The DiT is built as `benchmarks/full_size.py` builds it
(`build_dit_modules(preview_config())`, `random_init_`, bf16 on CUDA). Per size (512²/20 steps and
1024²/50 steps, conditions of 128 rows, guidance 9 on every step, no negative prompt):

- ``ms_per_step``: one guided step of one request (both CFG branches), median of CUDA-event timings;
  ``floor_ms_per_step``: the FLOP floor of that step (`benchmarks.dit_step.flop_floor`) at the
  measured bf16 matmul rate;
- at concurrency 1, 4 and 8, ``c`` requests submitted at once (``--waves`` times; DiT alone: noise,
  denoise, VAE, PNG encoding): ``images_per_min``, latency ``p50_s``/``p99_s`` (over the
  ``c x waves`` requests: with few samples p99 is close to the maximum) and ``peak_gib`` of GPU memory;
  each level after one untimed wave of ``c`` 2-step images (`warm_up`: the batch shape's first-call
  costs, e.g. its CUDA graph capture; until 2026-12-02 only one 2-step image per size, so the c = 4
  and c = 8 waves paid their capture inside the timing). A tree with `stage_dit.engine` runs them through its worker loop (``mode: engine``); an older one
  as the old servicer did, one `pipeline.generate` per thread (``mode: threads``).

``--tiny`` runs the tiny built-in dimensions on the CPU at 32²/4 and 64²/4 (a smoke test of the script,
`tests/unit/test_dit_batching_benchmark.py`). Budget on one H200: about 2.5 minutes per tree.
Output: the JSON at ``--out`` (``{"old": {...}, "new": {...}, "speedup": {...}}``) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: (side, steps, waves at concurrency 1): more single-image samples where they are cheap
FULL_SIZES = ((512, 20, 3), (1024, 50, 1))
TINY_SIZES = ((32, 4, 2), (64, 4, 1))
CONCURRENCY = (1, 4, 8)


# ------------------------------------------------------------------------------------------------
# Worker (runs inside the tree under test)
# ------------------------------------------------------------------------------------------------


def build_pipeline(tiny: bool):
    """The DiT pipeline of the tree on ``sys.path``: random weights, Preview size on CUDA (bf16) or
    the tiny dimensions on the CPU (float32)."""
    import torch

    try:
        from mammoth_app.make_checkpoint import PREVIEW_TOKENS, preview_config, tiny_config
    except ImportError:  # a tree from before `mammoth_app` (its checkpoint tools were in mammoth_core)
        from mammoth_core.make_checkpoint import PREVIEW_TOKENS, preview_config, tiny_config
    from stage_dit.pipeline import MammothDiTPipeline, build_dit_modules

    if tiny:
        config, _ = tiny_config(dict(PREVIEW_TOKENS))
        modules = build_dit_modules(config, device="cpu", dtype=torch.float32)
        return MammothDiTPipeline(modules, config, device="cpu", dtype=torch.float32)
    from benchmarks.full_size import random_preview_dit_pipeline

    config, _ = preview_config()
    return random_preview_dit_pipeline(config)


def timed_ms(fn, repeat: int, cuda: bool) -> float:
    """Median milliseconds of ``fn()`` after one warm-up (CUDA events on the GPU)."""
    import torch

    fn()
    times = []
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000.0 * (time.perf_counter() - t0))
    return statistics.median(times)


def step_fn(pipe, size: int, condition):
    """One guided step of one request at ``size``² (both branches), for the tree's API."""
    import torch

    latents = pipe.prepare_latents(width=size, height=size, seed=0)
    if not hasattr(pipe, "_velocity"):  # the batched step (`stage_dit.denoise`)
        from stage_dit.denoise import DenoiseState, ImageRequest, denoise_step

        graphs = getattr(pipe, "step_graphs", None)  # the served path: graph replays where the tree has them

        def step():
            state = DenoiseState(pipe, ImageRequest(condition, None, size, size, 50, 9.0), latents)
            denoise_step(pipe.transformer, [state], *([graphs] if graphs is not None else []))
        return step
    batched = pipe._batch_conditions([condition, condition.new_zeros(0, condition.shape[1])])
    t = torch.tensor(0.5, device=latents.device)

    def step():
        v_c, v_u = pipe._velocity(latents, t, None, batched)
        return latents + (v_u + 9.0 * (v_c - v_u)) * 0.02
    return step


def run_wave_threads(pipe, size: int, steps: int, condition, c: int) -> list[float]:
    """``c`` images at once, one `pipeline.generate` + PNG per thread (the old servicer's way)."""
    from stage_dit.images import encode_image

    latencies = [0.0] * c
    t0 = time.perf_counter()

    def one(i: int) -> None:
        image = pipe.generate(condition, None, width=size, height=size, num_inference_steps=steps,
                              text_guidance_scale=9.0, seed=i)
        encode_image(image, "png")
        latencies[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(c)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return latencies


def run_wave_engine(engine, size: int, steps: int, condition, c: int) -> list[float]:
    """``c`` images submitted at once to the worker loop (PNG output)."""
    from stage_dit.denoise import ImageRequest
    from stage_dit.engine import EngineJob, ImageFinished, RequestFailed

    latencies = [0.0] * c
    done = [threading.Event() for _ in range(c)]
    t0 = time.perf_counter()

    def sink_for(i: int):
        def sink(event):
            if isinstance(event, (ImageFinished, RequestFailed)):
                latencies[i] = time.perf_counter() - t0 if isinstance(event, ImageFinished) else float("nan")
                done[i].set()
        return sink

    for i in range(c):
        request = ImageRequest(condition, None, size, size, steps, 9.0, seed=i)
        engine.submit(EngineJob(prepare=lambda r=request: r, sink=sink_for(i), output_type="png"))
    for event in done:
        event.wait()
    return latencies


def measure_tree(args) -> dict:
    """Everything for the tree on ``sys.path`` (see the module docstring)."""
    import torch

    cuda = not args.tiny
    mode = args.mode
    if mode == "auto":
        try:
            import stage_dit.engine  # noqa: F401
            mode = "engine"
        except ImportError:
            mode = "threads"
    pipe = build_pipeline(args.tiny)
    rows = 128 if cuda else 16
    condition = torch.randn(rows, pipe.llm_hidden_size, device=pipe.device, dtype=pipe.dtype)
    result: dict = {"mode": mode, "tree": str(pathlib.Path(sys.path[0]).resolve()), "sizes": {},
                    "torch": torch.__version__}
    if cuda:
        from benchmarks.dit_step import flop_floor
        from benchmarks.full_size import ceilings, count

        result["bf16_flops_per_s"] = rate = ceilings()["bf16_flops_per_s"]
        dc = pipe.transformer.config
    engine = None
    if mode == "engine":
        from stage_dit.engine import DiTEngine

        engine = DiTEngine(pipe, max_batch_requests=max(args.concurrency))
    out = pathlib.Path(args.worker_out)
    try:
        for size, steps, c1_waves in (TINY_SIZES if args.tiny else FULL_SIZES):
            entry: dict = {"steps": steps}
            with torch.inference_mode():
                entry["ms_per_step"] = timed_ms(step_fn(pipe, size, condition), args.repeat, cuda)
            if cuda:
                tokens = (size // 16) ** 2 + rows
                flops = flop_floor(count(pipe.transformer), tokens, dc.hidden_size, dc.num_layers + dc.num_refiner_layers)
                entry["floor_ms_per_step"] = flops / rate * 1e3
            entry["concurrency"] = {}
            for c in args.concurrency:
                warm_up(pipe, engine, size, condition, c)
                entry["concurrency"][str(c)] = measure_level(pipe, engine, size, steps, condition, c,
                                                             c1_waves if c == 1 else args.waves, cuda)
            result["sizes"][str(size)] = entry
            print(json.dumps({size: entry}), flush=True)
            out.write_text(json.dumps(result))
    finally:
        if engine is not None:
            engine.close()
    graphs = getattr(pipe, "step_graphs", None)
    if graphs is not None:
        result["graphs"] = {"kept": len(graphs), "captures": graphs.captures, "replays": graphs.replays}
    if args.extras:
        from benchmarks.dit_profile import extras

        extras(pipe, condition, result, out, [size for size, _, _ in (TINY_SIZES if args.tiny else FULL_SIZES)])
    return result


def warm_up(pipe, engine, size: int, condition, c: int) -> None:
    """One wave of ``c`` 2-step images at ``size``, the way the level runs them: the first-call costs
    of that batch shape (VAE, kernels, cuDNN plans; in the worker loop the step's CUDA graph, captured
    on a shape's second step) are paid once per shape and process, not by the timed wave. The
    conditions here all have the same length, so every later wave of that size and concurrency reuses
    the shape; prompts of other lengths are other shapes (`stage_dit.graphs`)."""
    if engine is not None:
        run_wave_engine(engine, size, 2, condition, c)
    else:
        run_wave_threads(pipe, size, 2, condition, c)


def measure_level(pipe, engine, size, steps, condition, c: int, waves: int, cuda: bool) -> dict:
    """Images/min, p50/p99 latency and peak GPU memory of ``waves`` waves of ``c`` images."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    latencies, t0 = [], time.perf_counter()
    for _ in range(waves):
        if engine is not None:
            latencies += run_wave_engine(engine, size, steps, condition, c)
        else:
            latencies += run_wave_threads(pipe, size, steps, condition, c)
    wall = time.perf_counter() - t0
    latencies.sort()
    level = {"images": len(latencies), "images_per_min": 60.0 * len(latencies) / wall,
             "p50_s": statistics.median(latencies),
             "p99_s": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]}
    if cuda:
        level["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return level


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------


def run_tree(tree: pathlib.Path, args, mode: str, name: str, extras: bool = False) -> dict:
    """`measure_tree` in a subprocess whose ``sys.path`` starts with ``tree``; its JSON is kept next
    to ``--out`` as ``<stem>_<name>.json`` (rewritten after every size, so a run cut short keeps what it measured)."""
    out = pathlib.Path(args.out).resolve()
    part = out.with_name(f"{out.stem}_{name}.json")
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker-out", str(part), "--mode", mode,
           "--repeat", str(args.repeat), "--waves", str(args.waves),
           "--concurrency", ",".join(map(str, args.concurrency))] + (["--tiny"] if args.tiny else []) + (
           ["--extras"] if extras else [])
    inherited = os.environ.get("PYTHONPATH")  # keep what the caller's environment needs (installs)
    path = str(tree) + (os.pathsep + inherited if inherited else "")
    env = {**os.environ, "PYTHONPATH": path, "MAMMOTH_BENCH_TREE": str(tree)}
    subprocess.run(cmd, cwd=str(tree), env=env, check=True)
    return json.loads(part.read_text())


def speedups(old: dict, new: dict) -> dict:
    """new / old images per minute per size and concurrency, and old / new ms per step."""
    out: dict = {}
    for size, entry in new["sizes"].items():
        before = old["sizes"].get(size)
        if not before:
            continue
        out[size] = {"ms_per_step": before["ms_per_step"] / entry["ms_per_step"]}
        for c, level in entry["concurrency"].items():
            out[size][f"images_per_min_c{c}"] = level["images_per_min"] / before["concurrency"][c]["images_per_min"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old-tree", help="source tree of the code to compare with (checked out elsewhere)")
    parser.add_argument("--out", default="dit_batching.json", help="JSON result path")
    parser.add_argument("--tiny", action="store_true", help="tiny dimensions on the CPU (smoke test)")
    parser.add_argument("--repeat", type=int, default=10, help="timed single steps per size")
    parser.add_argument("--waves", type=int, default=1, help="waves of c requests per concurrency level")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                        type=lambda v: [int(x) for x in v.split(",")], help="concurrency levels, e.g. 1,4,8")
    parser.add_argument("--mode", default="auto", choices=("auto", "engine", "threads"),
                        help="how a tree runs concurrent requests (auto: its worker loop if it has one)")
    parser.add_argument("--old-mode", default="auto", choices=("auto", "engine", "threads"))
    parser.add_argument("--extras", action="store_true",
                        help="also, for this tree: step profile, graph check, step cache, bf16 bound (dit_profile.extras)")
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_out:  # inside a tree's subprocess
        tree = os.environ.get("MAMMOTH_BENCH_TREE", str(ROOT))
        sys.path[:] = [tree] + [p for p in sys.path if pathlib.Path(p or ".").resolve() != ROOT]
        pathlib.Path(args.worker_out).write_text(json.dumps(measure_tree(args)))
        return 0
    t0 = time.perf_counter()
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "tiny": args.tiny,
                    "command": " ".join(sys.argv)}
    if args.old_tree:
        result["old"] = run_tree(pathlib.Path(args.old_tree).resolve(), args, args.old_mode, "old")
    result["new"] = run_tree(ROOT, args, args.mode, "new", extras=args.extras)
    if "old" in result:
        result["speedup"] = speedups(result["old"], result["new"])
    result["wall_s"] = time.perf_counter() - t0
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result.get("speedup", {}), indent=2), f"\nwritten to {args.out} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
