"""``mammoth bench``: a serving benchmark against any gateway URL.

For each image size, step count, AR grid (``--ar-grid auto,32x32``: a sweep of the ``ar_grid``
extension) and concurrency level (comma lists): ``--warmup`` requests (not counted), then
``--requests`` requests kept ``concurrency`` in flight, each a non-streaming ``POST /v1/images/generations`` with the given size
and steps and a distinct seed. Reports mean/p50/p95 latency (seconds), images per minute, errors,
and the stage breakdown per request — mean/p50/p95 seconds of each stage in
`gateway.serving.STAGES` (queue, AR prefill and decode, transfer tail, DiT denoise, VAE, encode) —
read from each response's ``Server-Timing`` header, where each stage was measured by the component
that did the work. Prints a table; ``--json FILE`` writes the same results as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from typing import Any

import httpx

#: Stage names of the gateway's ``Server-Timing`` header, in pipeline order (`gateway.serving.STAGES`).
STAGES = ("queue", "ar_prefill", "ar_decode", "transfer", "dit_denoise", "dit_vae", "dit_encode")


def percentile(values: list[float], q: float) -> float:
    """``q``-quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def parse_server_timing(header: str | None) -> dict[str, float]:
    """``"queue;dur=1.5, ar_decode;dur=700"`` -> ``{"queue": 0.0015, "ar_decode": 0.7}`` (seconds)."""
    out: dict[str, float] = {}
    for part in (header or "").split(","):
        name, _, rest = part.strip().partition(";")
        for param in rest.split(";"):
            key, _, val = param.strip().partition("=")
            if key == "dur" and name:
                try:
                    out[name] = float(val) / 1e3
                except ValueError:
                    pass
    return out


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any],
               headers: dict[str, str]) -> tuple[bool, float, str, dict[str, float]]:
    """One request: (ok, latency s, error text, stage seconds from ``Server-Timing``)."""
    t0 = time.perf_counter()
    stages: dict[str, float] = {}
    try:
        r = await client.post(f"{url}/v1/images/generations", json=body, headers=headers)
        ok = r.status_code == 200
        why = "" if ok else f"{r.status_code}: {r.text[:200]}"
        stages = parse_server_timing(r.headers.get("server-timing")) if ok else {}
    except httpx.HTTPError as exc:
        ok, why = False, f"{type(exc).__name__}: {exc}"
    return ok, time.perf_counter() - t0, why, stages


async def run_level(
    url: str, concurrency: int, requests: int, warmup: int, size: str, steps: int, api_key: str | None,
    seed_base: int = 1000, ar_grid: str | None = None,
) -> dict[str, Any]:
    """Run one concurrency level; returns its result dict (latencies in seconds).

    ``ar_grid`` (``"auto"``, ``"WxH"``) is sent as the request's ``ar_grid``; None sends none (the
    gateway's ``default_ar_grid``).
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=10), limits=limits) as client:
        def body(i: int) -> dict[str, Any]:
            b = {"prompt": f"benchmark image {i}", "size": size, "num_inference_steps": steps,
                 "seed": seed_base + i, "response_format": "b64_json"}
            if ar_grid:
                b["ar_grid"] = ar_grid
            return b

        await asyncio.gather(*(_one(client, url, body(-1 - i), headers) for i in range(warmup)))
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(i)
        results: list[tuple[bool, float, str, dict[str, float]]] = []

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await _one(client, url, body(i), headers))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    lat = [r[1] for r in results if r[0]]
    stages: dict[str, dict[str, float]] = {}
    for stage in STAGES:
        values = [r[3][stage] for r in results if r[0] and stage in r[3]]
        if values:
            stages[stage] = {"mean_s": statistics.fmean(values), "p50_s": percentile(values, 0.5),
                             "p95_s": percentile(values, 0.95)}
    return {
        "concurrency": concurrency,
        "requests": requests,
        "ok": len(lat),
        "errors": [r[2] for r in results if not r[0]][:5],
        "wall_s": wall,
        "mean_s": statistics.fmean(lat) if lat else float("nan"),
        "p50_s": percentile(lat, 0.5),
        "p95_s": percentile(lat, 0.95),
        "images_per_min": 60.0 * len(lat) / wall if wall > 0 else 0.0,
        "stage_mean_s": {k: v["mean_s"] for k, v in stages.items()},
        "stages": stages,
    }


def render_table(results: list[dict[str, Any]]) -> str:
    """Two fixed-width tables: latency per level, then the per-stage breakdown (mean/p50/p95 s)."""
    head = f"{'conc':>4} {'ok':>5} {'mean s':>8} {'p50 s':>8} {'p95 s':>8} {'img/min':>8}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r['concurrency']:>4} {r['ok']:>2}/{r['requests']:<2} {r['mean_s']:>8.3f} {r['p50_s']:>8.3f} "
            f"{r['p95_s']:>8.3f} {r['images_per_min']:>8.1f}"
        )
    head2 = f"{'conc':>4} {'stage':<12} {'mean s':>8} {'p50 s':>8} {'p95 s':>8}"
    lines += ["", head2, "-" * len(head2)]
    for r in results:
        for stage in STAGES:
            st = r.get("stages", {}).get(stage)
            if st:
                lines.append(f"{r['concurrency']:>4} {stage:<12} {st['mean_s']:>8.4f} {st['p50_s']:>8.4f} "
                             f"{st['p95_s']:>8.4f}")
    return "\n".join(lines)


def _csv(value: Any) -> list[str]:
    return [v.strip() for v in str(value).split(",") if v.strip()]


def gateway_unreachable(url: str) -> str | None:
    """Why no gateway answers at ``url`` (``GET /healthz``), naming the URL and `mammoth up`; else None."""
    try:
        httpx.get(f"{url}/healthz", timeout=10.0)
    except httpx.HTTPError as exc:
        return (f"no gateway answers at {url} ({type(exc).__name__}: {exc}); start the pipeline with "
                "`mammoth up` (in another terminal) or pass --url")
    return None


def run_bench(args: argparse.Namespace) -> int:
    """Implementation of ``mammoth bench``; exit code 1 when any request failed.

    Levels: every combination of ``--size`` x ``--steps`` x ``--ar-grid`` x ``--concurrency``
    (comma lists; no ``--ar-grid``: the gateway's default grid).
    Exit code 2 for unusable arguments (no level run).
    """
    try:
        levels = [int(c) for c in _csv(args.concurrency)]
        step_list = [int(s) for s in _csv(args.steps)]
    except ValueError:
        levels, step_list = [], []
    if not levels or min(levels) < 1 or not step_list or min(step_list) < 1 or args.requests < 1 \
            or args.warmup < 0 or not _csv(args.size):
        print("mammoth bench: --concurrency and --steps need integers >= 1, --requests >= 1, "
              "--warmup >= 0 and at least one --size", file=sys.stderr)
        return 2
    unreachable = gateway_unreachable(args.url.rstrip("/"))
    if unreachable:
        print(f"mammoth bench: {unreachable}", file=sys.stderr)
        return 1
    grids = _csv(getattr(args, "ar_grid", "") or "") or [None]
    results = []
    for size, steps, grid, c in itertools.product(_csv(args.size), step_list, grids, levels):
        r = asyncio.run(run_level(args.url.rstrip("/"), c, args.requests, args.warmup, size, steps,
                                  getattr(args, "api_key", None), ar_grid=grid))
        r.update(size=size, steps=steps, ar_grid=grid or "default")
        results.append(r)
        print(f"{size} {steps} steps, ar_grid {grid or 'default'}, concurrency {c}: "
              f"{r['ok']}/{r['requests']} ok, p50 {r['p50_s']:.3f} s", file=sys.stderr)
        if r["errors"]:
            print(f"  errors: {r['errors']}", file=sys.stderr)
    for size, steps, grid in itertools.product(_csv(args.size), step_list, grids):
        print(f"\n== {size}, {steps} steps, ar_grid {grid or 'default'} ==")
        print(render_table([r for r in results if (r["size"], r["steps"], r["ar_grid"])
                            == (size, steps, grid or "default")]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": args.url, "sizes": _csv(args.size), "steps": step_list,
                       "ar_grids": [g or "default" for g in grids], "levels": results}, f, indent=2)
    return 0 if all(r["ok"] == r["requests"] for r in results) else 1
