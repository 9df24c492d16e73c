"""Clients that disconnect at random points leave nothing behind.

N requests (30 in CI, 200 with ``MAMMOTH_CHAOS_FULL=1``), JSON and SSE, 4 at a time, each sent over
a raw socket that is closed (FIN, or RST via ``SO_LINGER 0``) after a random delay drawn between 0
and 1.5x the measured request latency — before admission, while queued for a slot, while the AR
decodes, while the DiT denoises, or after the answer. Afterwards: no slot, pipeline or queued
request is left in the gateway, no slot in the DiT, no sequence in the AR; the resident memory of
every process is within 5 % of its value after warm-up; 20 follow-up requests all return 200.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import socket
import struct
import time

from chaos_harness import SIZE, STEPS, count, image_request, rss_bytes, wait_for

N_DISCONNECTS = count(30, 200)
N_FOLLOW_UP = 20
N_WARM_UP = 16
CONCURRENCY = 4
RSS_TOLERANCE = 0.05


def raw_request(address: str, delay: float, stream: bool, seed: int, reset: bool) -> None:
    """Send one image request over a raw socket and close it after ``delay`` seconds."""
    host, port = address.rsplit(":", 1)
    body = json.dumps({"prompt": "a red fox in the snow", "size": SIZE, "num_inference_steps": STEPS,
                       "seed": seed, "stream": stream}).encode()
    head = (f"POST /v1/images/generations HTTP/1.1\r\nHost: {address}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    try:
        sock.sendall(head + body)
        time.sleep(delay)
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()


def idle(cluster_procs) -> bool:
    gw, dit, ar = cluster_procs
    return (gw.metric("mammoth_gateway_slots_in_use") == 0
            and gw.metric("mammoth_gateway_active_requests") == 0
            and gw.metric("mammoth_gateway_active_pipelines") == 0
            and gw.metric("mammoth_gateway_queue_depth") == 0
            and dit.metric("mammoth_dit_slots_in_use") == 0
            and ar.metric("mammoth_ar_running_sequences") == 0)


def test_random_client_disconnects_leak_nothing(cluster, record_property):
    dit = cluster.stage("dit", "--slots", "2")
    ar = cluster.stage("ar")
    gw = cluster.gateway([ar], [dit])
    url = f"http://{gw.address}"
    procs = (gw, dit, ar)

    # warm-up: every code path the disconnects will take (JSON, SSE, cancellation) runs once
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(lambda i: image_request(url, seed=i, stream=bool(i % 2)),
                                range(N_WARM_UP)))
        latency = (time.monotonic() - t0) * CONCURRENCY / N_WARM_UP
        list(pool.map(lambda i: raw_request(gw.address, latency * (i % 4) / 4, bool(i % 2), i, bool(i % 3)),
                      range(8)))
    assert [r.status_code for r in results] == [200] * N_WARM_UP
    assert wait_for(lambda: idle(procs), 10.0)
    rss_before = {p.role: rss_bytes(p.pid) for p in procs}

    rng = random.Random(20240601)
    plan = [(rng.uniform(0.0, 1.5 * latency), rng.random() < 0.5, 1000 + i, rng.random() < 0.5)
            for i in range(N_DISCONNECTS)]
    t_flood = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        list(pool.map(lambda p: raw_request(gw.address, *p), plan))
    flood_s = time.monotonic() - t_flood

    t_idle = time.monotonic()
    assert wait_for(lambda: idle(procs), 10.0), [p.log.read_text()[-2000:] for p in procs]
    settle_s = time.monotonic() - t_idle
    rss_after = {p.role: rss_bytes(p.pid) for p in procs}
    growth = {role: rss_after[role] / rss_before[role] - 1.0 for role in rss_before}
    cancelled = gw.metric("mammoth_gateway_requests_total", outcome="cancelled")

    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        follow = list(pool.map(lambda i: image_request(url, seed=5000 + i, stream=bool(i % 2)),
                               range(N_FOLLOW_UP)))
    statuses = [r.status_code for r in follow]
    summary = {"disconnects": N_DISCONNECTS, "latency_s": round(latency, 3), "flood_s": round(flood_s, 1),
               "settle_s": round(settle_s, 2), "cancelled_requests": cancelled,
               "rss_mib_before": {k: round(v / 2**20, 1) for k, v in rss_before.items()},
               "rss_growth_pct": {k: round(100 * v, 2) for k, v in growth.items()},
               "follow_up_200": statuses.count(200)}
    record_property("chaos_disconnects", json.dumps(summary))
    print("chaos disconnects:", json.dumps(summary))
    assert statuses == [200] * N_FOLLOW_UP, statuses
    assert all(g <= RSS_TOLERANCE for g in growth.values()), summary
