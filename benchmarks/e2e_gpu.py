"""End-to-end latency through the real gRPC path, with the stage breakdown, and the transfer tail
streamed vs request-end.

Run on the GPU machine from the source tree (two GPUs: the AR on the first, the DiT on the second):

    PYTHONPATH=. python3 benchmarks/e2e_gpu.py --out "$OUT" [--dit-step-json $OUT/dit_step.json]

1. A full-size checkpoint (MammothModa2-Preview dimensions, `preview_config()`, random bf16 weights
   built on the GPU) is written once to --ckpt-dir with tokenizer files whose base vocabulary is
   padded to 152,064 ids and whose 16,384 visual codes start at 152,072, so the generation ids equal
   the Preview's (the few placeholder ids the small tokenizer puts elsewhere are written into the
   config). ``--checkpoint builtin://tiny`` skips this (CPU smoke test of the harness).
2. The DiT (``CUDA_VISIBLE_DEVICES=--dit-gpu``), the AR (``=--ar-gpu``) and the gateway (no GPU) are
   started as separate processes from the source tree (``python -m mammoth_app.cli ...``).
3. Phase ``streamed`` (the AR's default ``chunk_rows``): per SIZE:STEPS, one warm-up request, then per
   AR grid (``--ar-grids auto,32x32``: the ``ar_grid`` request extension, issue 23) and
   concurrency level ``max(c, --min-requests)`` requests kept ``c`` in flight through
   ``POST /v1/images/generations``; latency per request and its ``Server-Timing`` breakdown
   (``ar_prefill``, ``ar_decode``, ``transfer`` = last chunk sent by the AR -> conditions resident on
   the DiT GPU, ``dit_denoise``, ``dit_vae``, ``dit_encode``).
4. Phase ``request_end``: the AR restarted with ``--chunk-rows`` larger than any request, so the
   whole payload leaves as one message after the last row was produced (the request-end baseline);
   concurrency 1 at each size.
"AR alone" is the AR's own prefill + decode time at concurrency 1 (reported by the AR engine);
"DiT alone" is `benchmarks/dit_step.py`'s in-process `generate` time (``--dit-step-json``).
The DiT writes its per-request stream traces (`MAMMOTH_TRACE_DIR`), from which each level also
reports the transfer tail's phases (`tail_phases`: AR framed -> DiT handler -> staged -> resident).
Results: tables on stdout and `e2e_gpu.json` in --out (rewritten after every level).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mammoth_app.bench import parse_server_timing, percentile  # noqa: E402
from mammoth_app.local import Component, StartupError, stop_pipeline  # noqa: E402

GiB = 1024**3
TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
GEN_KEYS = ("eol_token_id", "visual_token_start_id", "visual_token_end_id", "boi_token_id", "eoi_token_id")


# ------------------------------------------------------------------------------------------------
# Checkpoint
# ------------------------------------------------------------------------------------------------


def preview_checkpoint_config(folder: pathlib.Path) -> tuple[dict, dict]:
    """Write the tokenizer files into ``folder`` and return ``(config, generation)`` of the Preview
    dimensions with the token ids of that tokenizer.

    Raises:
        ValueError: if the tokenizer's generation ids differ from the Preview's (they must not).
    """
    from mammoth_app.make_checkpoint import PREVIEW_TOKENS, preview_config
    from stage_ar.tokenization_mammoth import write_tokenizer_files

    ids = write_tokenizer_files(folder, num_visual_tokens=16384, base_vocab_size=PREVIEW_TOKENS["vocab_size"])
    for key in ("vocab_size", "gen_vocab_start_index", "eol_token_id", "visual_token_start_id", "visual_token_end_id",
                "boi_token_id"):
        if ids[key] != PREVIEW_TOKENS[key]:
            raise ValueError(f"tokenizer {key} = {ids[key]}, Preview {PREVIEW_TOKENS[key]}")
    config, generation = preview_config()
    for key in TOKEN_KEYS:
        config["llm_config"][key] = ids[key]
    for key in GEN_KEYS:
        generation[key] = ids[key]
    return config, generation


def build_preview_checkpoint(folder: pathlib.Path) -> float:
    """Write the full-size random checkpoint once (``.complete`` marks it); returns seconds spent."""
    import torch

    from benchmarks.full_size import random_preview_modules
    from mammoth_app.make_checkpoint import save_sharded

    if (folder / ".complete").is_file():
        return 0.0
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    config, generation = preview_checkpoint_config(folder)
    ar, dit = random_preview_modules(config)
    state = {f"llm_model.{k}": v.cpu() for k, v in ar.state_dict().items()}
    for prefix, m in dit.named_modules_by_prefix().items():
        state.update({f"{prefix}.{k}": v.cpu() for k, v in m.state_dict().items()})
    del ar, dit
    torch.cuda.empty_cache()
    save_sharded(state, folder, shard_bytes=5 * GiB)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "t2i_generation_config.json").write_text(json.dumps(generation, indent=2))
    (folder / ".complete").write_text("ok\n")
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------
# Processes
# ------------------------------------------------------------------------------------------------


def spawn(name: str, argv: list[str], workdir: pathlib.Path, env: dict[str, str]) -> Component:
    ready = workdir / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    log = open(workdir / f"{name}.log", "ab")  # noqa: SIM115 (kept open for the process' life)
    cmd = [sys.executable, "-m", "mammoth_app.cli", *argv, "--ready-file", str(ready)]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT),
                            start_new_session=True)
    return Component(name=name, proc=proc, ready_file=ready)


def component_env(gpu: str | None) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def start_stages(args, workdir: pathlib.Path, chunk_rows: int | None,
                 trace_dir: pathlib.Path | None = None) -> list[Component]:
    """DiT, AR (each on its GPU), then the gateway; returns them once all are ready. With
    ``trace_dir`` the DiT writes each request's stream trace there (`MAMMOTH_TRACE_DIR`)."""
    common = ["--host", "127.0.0.1", "--log-level", "warning"]
    stage = [*common, "--checkpoint", args.checkpoint, "--port", "0", "--metrics-port", "0"]
    comps: list[Component] = []
    from mammoth_app.local import free_port, generate_role_tokens

    tokens = generate_role_tokens(workdir)  # stages refuse unauthenticated calls
    dit_port = free_port()  # the AR dials only the DiT it is told about
    try:
        dit_env = {**component_env(args.dit_gpu), **tokens}
        if trace_dir is not None:
            trace_dir.mkdir(parents=True, exist_ok=True)
            dit_env["MAMMOTH_TRACE_DIR"] = str(trace_dir)
        dit = spawn("dit", ["dit", *stage, "--port", str(dit_port), "--slots", str(args.dit_slots)], workdir,
                    dit_env)
        comps.append(dit)
        ar_extra = ["--chunk-rows", str(chunk_rows)] if chunk_rows else []
        ar_extra += ["--dit-allow-list", f"127.0.0.1:{dit_port}"]
        ar = spawn("ar", ["ar", *stage, "--max-running-sequences", str(args.ar_slots), *ar_extra], workdir,
                   {**component_env(args.ar_gpu), **tokens})
        comps.append(ar)
        dit_addr = dit.wait_ready(args.ready_timeout)
        ar_addr = ar.wait_ready(args.ready_timeout)
        gw = spawn("gateway", ["gateway", *common, "--port", "0", "--ar", ar_addr, "--dit", dit_addr], workdir,
                   {**component_env(""), **tokens})
        comps.append(gw)
        gw.wait_ready(args.ready_timeout)
    except BaseException:
        stop_pipeline(comps)
        raise
    return comps


def tail_phases(trace_dir: pathlib.Path, seen: set[pathlib.Path]) -> tuple[dict[str, float], set[pathlib.Path]]:
    """p50 of the transfer tail's phases over the DiT traces written since ``seen`` (ms): ``wire``
    = the AR framed the last chunk -> the DiT's handler took it; ``accept`` = -> validated and
    copied into pinned staging (H2D launched); ``resident`` = -> H2D complete, slot finished;
    ``tail`` = all of it. Returns (phases, every trace file now)."""
    files = set(trace_dir.glob("*.dit.json"))
    rows: dict[str, list[float]] = {"wire": [], "accept": [], "resident": [], "tail": []}
    for path in sorted(files - seen):
        t = json.loads(path.read_text())
        sent, received, resident = t.get("last_sent_unix_ms"), t.get("last_received_unix_ms"), t.get("resident_unix_ms")
        if not (sent and received and resident and t.get("chunks")):
            continue
        arrived = t["chunks"][-1]["arrived_unix_ms"]
        for key, value in (("wire", received - sent), ("accept", arrived - received),
                           ("resident", resident - arrived), ("tail", resident - sent)):
            rows[key].append(value)
    phases = {k: percentile(v, 0.5) for k, v in rows.items() if v}
    if rows["tail"]:
        phases["n"] = len(rows["tail"])
    return phases, files


# ------------------------------------------------------------------------------------------------
# Requests
# ------------------------------------------------------------------------------------------------


async def _stage_sums(client, url: str) -> dict[str, tuple[float, float]]:
    """``{stage: (sum_seconds, count)}`` of the gateway's ``mammoth_gateway_stage_duration_seconds``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    metric = "mammoth_gateway_stage_duration_seconds"
    try:
        text = (await client.get(f"{url}/metrics", timeout=10)).text
    except httpx.HTTPError:
        return {}
    acc: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (metric + "_sum", metric + "_count"):
                pair = acc.setdefault(sample.labels.get("stage", "?"), [0.0, 0.0])
                pair[0 if sample.name.endswith("_sum") else 1] += sample.value
    return {k: (v[0], v[1]) for k, v in acc.items()}


async def run_level(url: str, size: int, steps: int, concurrency: int, requests: int, seed: int,
                    ar_grid: str | None = None) -> dict[str, Any]:
    """``requests`` requests, ``concurrency`` in flight; per-request latency and Server-Timing.
    ``ar_grid`` is sent as the request's ``ar_grid`` extension (None: the gateway's default)."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(1200, connect=10),
                                 limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        before = await _stage_sums(client, url)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(i)
        per: list[dict[str, Any]] = []

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                body = {"prompt": f"benchmark image {seed + i}", "size": f"{size}x{size}",
                        "num_inference_steps": steps, "seed": seed + i, "response_format": "b64_json"}
                if ar_grid:
                    body["ar_grid"] = ar_grid
                t0 = time.perf_counter()
                try:
                    r = await client.post(f"{url}/v1/images/generations", json=body)
                    ok, why = r.status_code == 200, "" if r.status_code == 200 else f"{r.status_code}: {r.text[:300]}"
                    timing = parse_server_timing(r.headers.get("server-timing", ""))
                except httpx.HTTPError as exc:
                    ok, why, timing = False, f"{type(exc).__name__}: {exc}", {}
                per.append({"ok": ok, "latency_s": time.perf_counter() - t0, "error": why, "timing_s": timing})

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        after = await _stage_sums(client, url)
    good = [p for p in per if p["ok"]]
    lat = [p["latency_s"] for p in good]
    stages: dict[str, float] = {}
    for stage, (s1, c1) in after.items():
        s0, c0 = before.get(stage, (0.0, 0.0))
        if c1 > c0:
            stages[stage] = (s1 - s0) / (c1 - c0)

    def med(key: str) -> float:
        vals = [p["timing_s"][key] for p in good if key in p["timing_s"]]
        return statistics.median(vals) if vals else float("nan")

    transfer_ms = [1e3 * p["timing_s"]["transfer"] for p in good if "transfer" in p["timing_s"]]
    return {
        "size": size, "steps": steps, "ar_grid": ar_grid or "default", "concurrency": concurrency,
        "requests": requests, "ok": len(good),
        "errors": [p["error"] for p in per if not p["ok"]][:3], "wall_s": wall,
        "latency_mean_s": statistics.fmean(lat) if lat else float("nan"),
        "latency_p50_s": percentile(lat, 0.5), "latency_max_s": max(lat, default=float("nan")),
        "images_per_min": 60.0 * len(lat) / wall if wall else 0.0,
        "ar_s_p50": med("ar_prefill") + med("ar_decode"), "ar_prefill_s_p50": med("ar_prefill"),
        "transfer_ms_p50": percentile(transfer_ms, 0.5), "transfer_ms_max": max(transfer_ms, default=float("nan")),
        "dit_denoise_s_p50": med("dit_denoise"), "dit_vae_s_p50": med("dit_vae"),
        "dit_encode_s_p50": med("dit_encode"), "queue_s_p50": med("queue"),
        "histogram_stage_mean_s": stages, "per_request": per,
    }


def row(r: dict[str, Any]) -> str:
    return (f"{r['size']:>5} {r['steps']:>3} {r['ar_grid']:>7} {r['concurrency']:>3} {r['ok']:>2}/{r['requests']:<2} "
            f"{r['latency_p50_s']:>8.2f} {r['latency_max_s']:>8.2f} {r['images_per_min']:>7.2f} "
            f"{r['ar_s_p50']:>7.2f} {r['transfer_ms_p50']:>8.2f} {r['dit_denoise_s_p50']:>7.2f} "
            f"{r['dit_vae_s_p50']:>6.3f} {r['dit_encode_s_p50']:>6.3f} {r['queue_s_p50']:>6.2f}")


HEADER = ("size stp ar_grid  c  ok     p50 s    max s img/min    AR s  xfer ms   DiT s  vae s  enc s queue")


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--checkpoint", default="/tmp/mammoth-preview-e2e", help="folder (built if absent) or builtin://tiny")
    p.add_argument("--sizes", default="512:20,1024:50", help="SIZE:STEPS list (streamed phase)")
    p.add_argument("--concurrency", default="1,2,4")
    p.add_argument("--ar-grids", default="", help="ar_grid per streamed level, e.g. auto,32x32 (comma list; "
                   "'' = none sent, the gateway's default_ar_grid); every size x grid x concurrency runs")
    p.add_argument("--min-requests", type=int, default=1, help="requests per level at least (else = concurrency)")
    p.add_argument("--baseline-sizes", default="512:20,1024:50", help="SIZE:STEPS[:REQUESTS] for the request-end phase ('' = skip)")
    p.add_argument("--ar-gpu", default="0")
    p.add_argument("--dit-gpu", default="1")
    p.add_argument("--ar-slots", type=int, default=8)
    p.add_argument("--dit-slots", type=int, default=4)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--budget-s", type=float, default=1e9, help="skip levels that would start after this many seconds")
    p.add_argument("--dit-step-json", default=None, help="dit_step.json for 'DiT alone'")
    args = p.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "command": " ".join(sys.argv), "ar_gpu": args.ar_gpu, "dit_gpu": args.dit_gpu,
                           "levels": [], "request_end": []}
    try:
        import torch

        if torch.cuda.is_available():
            res["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            res["torch"] = torch.__version__
    except ImportError:
        pass

    def save() -> None:
        (out / "e2e_gpu.json").write_text(json.dumps(res, indent=2, default=str))

    if not args.checkpoint.startswith("builtin://"):
        res["checkpoint_build_s"] = build_preview_checkpoint(pathlib.Path(args.checkpoint))
        print(f"checkpoint ready ({res['checkpoint_build_s']:.1f} s)", flush=True)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="mammoth-e2e-"))
    res["logs"] = str(workdir)
    sizes = [tuple(int(x) for x in s.split(":")) for s in args.sizes.split(",") if s]
    levels = [int(c) for c in args.concurrency.split(",") if c]

    def phase(chunk_rows: int | None, plan: list[tuple[int, int, int]], key: str) -> None:
        t0 = time.perf_counter()
        trace_dir = workdir / f"trace-{key}"
        try:
            comps = start_stages(args, workdir, chunk_rows, trace_dir)
        except StartupError as exc:
            res.setdefault("startup_errors", []).append(str(exc))
            print(f"startup failed: {exc}", flush=True)
            for name in ("dit", "ar", "gateway"):
                logf = workdir / f"{name}.log"
                if logf.is_file():
                    print(f"--- {name}.log (tail)\n" + logf.read_text(errors="replace")[-3000:], flush=True)
            return
        res.setdefault("startup_s", {})[key] = time.perf_counter() - t0
        url = f"http://{comps[-1].address}"
        print(f"[{key}] up in {time.perf_counter() - t0:.1f} s at {url}", flush=True)
        print(HEADER, flush=True)
        try:
            warmed: set[int] = set()
            for size, steps, c, grid, *count in plan:
                if time.perf_counter() - started > args.budget_s:
                    res.setdefault("skipped", []).append([key, size, steps, c, grid])
                    continue
                if not warmed and key == "streamed":  # one warm-up request per phase start (first size)
                    asyncio.run(run_level(url, size, steps, 1, 1, seed=99))
                    warmed.add(size)
                n = count[0] if count else max(c, args.min_requests)
                _, seen = tail_phases(trace_dir, set())
                r = asyncio.run(run_level(url, size, steps, c, n, seed=1000 * c + size, ar_grid=grid))
                r["tail_phases_ms_p50"], _ = tail_phases(trace_dir, seen)
                res[key if key == "request_end" else "levels"].append(r)
                print(row(r), flush=True)
                print("   transfer tail p50 by phase (ms, DiT trace):", json.dumps(
                    {k: round(v, 3) for k, v in r["tail_phases_ms_p50"].items()}), flush=True)
                if r["errors"]:
                    print("   errors:", r["errors"], flush=True)
                save()
        finally:
            stop_pipeline(comps)

    grids = [g for g in args.ar_grids.split(",") if g] or [None]
    phase(None, [(s, st, c, g) for s, st in sizes for g in grids for c in levels], "streamed")
    base = [[int(x) for x in s.split(":")] for s in args.baseline_sizes.split(",") if s]
    if base:
        phase(1_000_000, [(b[0], b[1], 1, None, b[2] if len(b) > 2 else 1) for b in base], "request_end")

    # Summary against the targets
    dit_alone = {}
    if args.dit_step_json and pathlib.Path(args.dit_step_json).is_file():
        ds = json.loads(pathlib.Path(args.dit_step_json).read_text())
        dit_alone = {int(k): v["dit_alone_s"] for k, v in ds.get("sizes", {}).items()}
    summary = []
    for r in res["levels"]:
        if r["concurrency"] != 1:
            continue
        base_r = next((b for b in res["request_end"] if b["size"] == r["size"] and b["steps"] == r["steps"]
                       and r["ar_grid"] == "default"), None)
        alone = r["ar_s_p50"] + dit_alone.get(r["size"], float("nan"))
        summary.append({
            "size": r["size"], "steps": r["steps"], "ar_grid": r["ar_grid"], "e2e_p50_s": r["latency_p50_s"],
            "ar_alone_s": r["ar_s_p50"], "dit_alone_s": dit_alone.get(r["size"]),
            "e2e_over_alone": r["latency_p50_s"] / alone if alone == alone else None,
            "transfer_tail_ms_p50_streamed": r["transfer_ms_p50"],
            "transfer_tail_ms_p50_request_end": base_r["transfer_ms_p50"] if base_r else None,
            "e2e_p50_s_request_end": base_r["latency_p50_s"] if base_r else None,
        })
    res["summary"] = summary
    res["total_s"] = time.perf_counter() - started
    save()
    print("\nsummary (concurrency 1):", flush=True)
    for s in summary:
        print(json.dumps(s), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
