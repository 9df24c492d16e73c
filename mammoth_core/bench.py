"""``mammoth bench``: a serving benchmark against any gateway URL.

For each concurrency level: ``--warmup`` requests (not counted), then ``--requests`` requests kept
``concurrency`` in flight, each a non-streaming ``POST /v1/images/generations`` with the given size
and steps and a distinct seed. Reports mean/p50/p95 latency (seconds), images per minute, errors,
and the stage breakdown (AR, transfer tail, DiT: mean seconds per image) computed from the
gateway's ``mammoth_gateway_stage_duration_seconds`` histogram scraped before and after the level.
Prints a table; ``--json FILE`` writes the same results as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import httpx

STAGE_METRIC = "mammoth_gateway_stage_duration_seconds"


def _percentile(values: list[float], q: float) -> float:
    """``q``-quantile (0..1) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


async def _stage_sums(client: httpx.AsyncClient, url: str) -> dict[str, tuple[float, float]]:
    """``{stage: (sum_seconds, count)}`` from the gateway's stage histogram (empty if unavailable)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = (await client.get(f"{url}/metrics", timeout=10)).text
    except httpx.HTTPError:
        return {}
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (STAGE_METRIC + "_sum", STAGE_METRIC + "_count"):
                stage = s.labels.get("stage", "?")
                acc = out.setdefault(stage, [0.0, 0.0])
                acc[0 if s.name.endswith("_sum") else 1] += s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[bool, float, str]:
    t0 = time.perf_counter()
    try:
        r = await client.post(f"{url}/v1/images/generations", json=body, headers=headers)
        ok = r.status_code == 200
        why = "" if ok else f"{r.status_code}: {r.text[:200]}"
    except httpx.HTTPError as exc:
        ok, why = False, f"{type(exc).__name__}: {exc}"
    return ok, time.perf_counter() - t0, why


async def run_level(
    url: str, concurrency: int, requests: int, warmup: int, size: str, steps: int, api_key: str | None,
    seed_base: int = 1000,
) -> dict[str, Any]:
    """Run one concurrency level; returns its result dict (latencies in seconds)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=10), limits=limits) as client:
        def body(i: int) -> dict[str, Any]:
            return {"prompt": f"benchmark image {i}", "size": size, "num_inference_steps": steps,
                    "seed": seed_base + i, "response_format": "b64_json"}

        await asyncio.gather(*(_one(client, url, body(-1 - i), headers) for i in range(warmup)))
        before = await _stage_sums(client, url)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(i)
        results: list[tuple[bool, float, str]] = []

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
        after = await _stage_sums(client, url)
    lat = [r[1] for r in results if r[0]]
    stages = {}
    for stage, (s1, c1) in after.items():
        s0, c0 = before.get(stage, (0.0, 0.0))
        if c1 > c0:
            stages[stage] = (s1 - s0) / (c1 - c0)
    return {
        "concurrency": concurrency,
        "requests": requests,
        "ok": len(lat),
        "errors": [r[2] for r in results if not r[0]][:5],
        "wall_s": wall,
        "mean_s": statistics.fmean(lat) if lat else float("nan"),
        "p50_s": _percentile(lat, 0.5),
        "p95_s": _percentile(lat, 0.95),
        "images_per_min": 60.0 * len(lat) / wall if wall > 0 else 0.0,
        "stage_mean_s": stages,
    }


def render_table(results: list[dict[str, Any]]) -> str:
    """A fixed-width table of the levels."""
    head = f"{'conc':>4} {'ok':>5} {'mean s':>8} {'p50 s':>8} {'p95 s':>8} {'img/min':>8}  {'AR s':>7} {'xfer s':>7} {'DiT s':>7}"
    lines = [head, "-" * len(head)]
    for r in results:
        st = r["stage_mean_s"]
        lines.append(
            f"{r['concurrency']:>4} {r['ok']:>2}/{r['requests']:<2} {r['mean_s']:>8.3f} {r['p50_s']:>8.3f} "
            f"{r['p95_s']:>8.3f} {r['images_per_min']:>8.1f}  {st.get('ar', float('nan')):>7.3f} "
            f"{st.get('transfer', float('nan')):>7.4f} {st.get('dit', float('nan')):>7.3f}"
        )
    return "\n".join(lines)


def run_bench(args: argparse.Namespace) -> int:
    """Implementation of ``mammoth bench``; exit code 1 when any request failed."""
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    results = []
    for c in levels:
        r = asyncio.run(run_level(args.url.rstrip("/"), c, args.requests, args.warmup, args.size, args.steps,
                                  getattr(args, "api_key", None)))
        results.append(r)
        print(f"concurrency {c}: {r['ok']}/{r['requests']} ok, p50 {r['p50_s']:.3f} s", file=sys.stderr)
    print(render_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"url": args.url, "size": args.size, "steps": args.steps, "levels": results}, f, indent=2)
    return 0 if all(r["ok"] == r["requests"] for r in results) else 1
