"""How fast stage faults are noticed, and how fast a drained stage leaves, at the gateway's default
settings (docs/RELIABILITY.md, "Fault handling"; issue 24).

- ``kill -9`` of the only AR / the only DiT mid-request: a clean error within 1.5 s, the other
  stage's resources (DiT slot, AR sequence) freed within 1 s of the death; a request queued behind
  the dead replica fails as fast, with ``Retry-After``.
- SIGSTOP of one of two DiTs (or ARs): marked down within 3 s, the request finishes on the other
  replica with the same bytes as a run without the fault.
- SIGTERM: an idle stage exits within 2 s (the gateway's health watches are no work); a stage with
  work exits within 1 s of its last request; requests queued behind a draining only-replica fail
  fast with ``Retry-After`` (no replacement is waited for).

Every measured duration is printed as ``MEASURED <name> <seconds>`` (run with ``-s``); the kill -9
tests run 1 round in CI and 5 with ``MAMMOTH_CHAOS_FULL=1``.
"""

from __future__ import annotations

import pytest

import concurrent.futures
import time

from chaos_harness import (BIG, assert_envelope, count, image_request, reference_image,
                           sse_events, stream_until_ar_progress, wait_for)

#: minutes of real-process kills per run: behind `slow` (docs/TESTING.md)
pytestmark = pytest.mark.slow

#: kill -9 rounds per test (the killed stage is restarted between rounds): 1 in CI, 5 in full.
ROUNDS = count(1, 5)
#: Upper bounds of issue 24, seconds.
FAILED_REQUEST_S = 1.5
FREED_S = 1.0
MARKED_DOWN_S = 3.0
IDLE_EXIT_S = 2.0
EXIT_AFTER_WORK_S = 1.0
#: Drain grace of the stages under test: long, so that an exit at the grace fails the test (and
#: longer with work: two 512x512 requests take over 10 s on a loaded 2-core CI host).
GRACE = "10"
WORK_GRACE = "60"


def measured(name: str, seconds: float) -> float:
    print(f"MEASURED {name} {seconds:.3f}")
    return seconds


def when(pool: concurrent.futures.Executor, predicate, timeout: float = 10.0):
    """A future of the monotonic time at which ``predicate`` first held (None: never within
    ``timeout``), polled every 20 ms in a thread of ``pool``."""

    def poll():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if predicate():
                    return time.monotonic()
            except Exception:  # noqa: BLE001 - a scrape racing a dying process: poll again
                pass
            time.sleep(0.02)
        return None

    return pool.submit(poll)


def exited_at(pool: concurrent.futures.Executor, proc, timeout: float = 30.0):
    """A future of (monotonic exit time, exit code) of ``proc``."""

    def wait():
        code = proc.proc.wait(timeout)
        return time.monotonic(), code

    return pool.submit(wait)


def timed_request(url: str, **kwargs) -> tuple[float, object]:
    response = image_request(url, **kwargs)
    return time.monotonic(), response


def _kill9_the_only_ar_round(gw, ar, dit) -> None:
    url = f"http://{gw.address}"
    client, cm, lines = stream_until_ar_progress(url)
    assert dit.metric("mammoth_dit_slots_in_use") == 1
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        t_kill = time.monotonic()
        ar.kill9()
        freed = when(pool, lambda: dit.metric("mammoth_dit_slots_in_use") == 0)
        events = sse_events(lines)
        t_error = time.monotonic()
        cm.__exit__(None, None, None)
        client.close()
        t_freed = freed.result()
    assert events and events[-1]["event"] == "error", events[-3:]
    assert events[-1]["error"]["code"] == "no_backend", events[-1]
    assert measured("kill9_only_ar_error", t_error - t_kill) <= FAILED_REQUEST_S
    assert t_freed is not None
    assert measured("kill9_only_ar_dit_slot_freed", t_freed - t_kill) <= FREED_S
    # a new request is answered at once: 503 with Retry-After
    t0 = time.monotonic()
    r = image_request(url)
    assert_envelope(r, (503,))
    assert int(r.headers["retry-after"]) >= 1
    assert time.monotonic() - t0 < FAILED_REQUEST_S
    assert gw.metric("mammoth_gateway_slots_in_use") == 0
    assert gw.metric("mammoth_gateway_active_pipelines") == 0


def test_kill9_the_only_ar_fails_fast_and_the_dit_slot_is_freed(cluster):
    dit = cluster.stage("dit", "--slots", "2")
    ar = cluster.stage("ar")
    gw = cluster.gateway([ar], [dit], health_interval=None)
    for i in range(ROUNDS):
        if i:
            ar = cluster.restart(ar)
            assert wait_for(lambda: gw.metric("mammoth_gateway_backends_serving", stage="ar") == 1, 30.0)
        _kill9_the_only_ar_round(gw, ar, dit)


def _kill9_the_only_dit_round(gw, ar, dit) -> None:
    url = f"http://{gw.address}"
    client, cm, lines = stream_until_ar_progress(url)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        queued = pool.submit(timed_request, url, seed=9)  # waits for the only slot
        assert wait_for(lambda: gw.metric("mammoth_gateway_queue_depth") == 1, 10.0)
        t_kill = time.monotonic()
        dit.kill9()
        freed = when(pool, lambda: ar.metric("mammoth_ar_running_sequences") == 0)
        events = sse_events(lines)
        t_error = time.monotonic()
        cm.__exit__(None, None, None)
        client.close()
        t_queued, r = queued.result()
        t_freed = freed.result()
    assert events and events[-1]["event"] == "error", events[-3:]
    assert measured("kill9_only_dit_error", t_error - t_kill) <= FAILED_REQUEST_S
    assert_envelope(r, (503,))
    assert int(r.headers["retry-after"]) >= 1
    assert measured("kill9_only_dit_queued_error", t_queued - t_kill) <= FAILED_REQUEST_S
    assert t_freed is not None
    assert measured("kill9_only_dit_ar_sequence_freed", t_freed - t_kill) <= FREED_S


def test_kill9_the_only_dit_fails_fast_queued_requests_too_and_the_ar_is_freed(cluster):
    dit = cluster.stage("dit", "--slots", "1")
    ar = cluster.stage("ar")
    gw = cluster.gateway([ar], [dit], health_interval=None)
    for i in range(ROUNDS):
        if i:
            dit = cluster.restart(dit)
            assert wait_for(lambda: gw.metric("mammoth_gateway_backends_serving", stage="dit") == 1, 30.0)
        _kill9_the_only_dit_round(gw, ar, dit)


def test_sigstop_of_a_dit_is_marked_down_and_the_request_finishes_on_the_other(cluster):
    dits = [cluster.stage("dit", "--slots", "1") for _ in range(2)]
    ar = cluster.stage("ar")
    gw = cluster.gateway([ar], dits, health_interval=None)
    url = f"http://{gw.address}"
    t0 = time.monotonic()
    expected = reference_image(url)
    measured("sigstop_reference_request", time.monotonic() - t0)
    client, cm, lines = stream_until_ar_progress(url)
    (busy,) = [d for d in dits if d.metric("mammoth_dit_slots_in_use") == 1]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        t_stop = time.monotonic()
        busy.sigstop()
        try:
            marked = when(pool, lambda: gw.metric("mammoth_gateway_backends_serving", stage="dit") == 1)
            events = sse_events(lines)
            t_done = time.monotonic()
            cm.__exit__(None, None, None)
            client.close()
            t_marked = marked.result()
        finally:
            busy.sigcont()
    assert t_marked is not None
    assert measured("sigstop_dit_marked_down", t_marked - t_stop) <= MARKED_DOWN_S
    assert events[-1]["event"] == "image_generation.completed", events[-3:]
    assert events[-1]["b64_json"] == expected  # the same bytes as the run without the fault
    measured("sigstop_dit_request_done_after_stop", t_done - t_stop)
    assert gw.metric("mammoth_gateway_retries_total", stage="dit") >= 1


def test_sigstop_of_an_ar_is_routed_around_with_the_next_epoch(cluster):
    """The same detection for the AR: the frozen AR's call fails as hung, the request goes on with
    ``epoch + 1`` on the other AR (the DiT slot survives) and the image has the same bytes."""
    dit = cluster.stage("dit", "--slots", "2")
    ars = [cluster.stage("ar") for _ in range(2)]
    gw = cluster.gateway(ars, [dit], health_interval=None)
    url = f"http://{gw.address}"
    expected = reference_image(url)
    client, cm, lines = stream_until_ar_progress(url)
    (busy,) = [a for a in ars if a.metric("mammoth_ar_running_sequences") == 1]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        t_stop = time.monotonic()
        busy.sigstop()
        try:
            marked = when(pool, lambda: gw.metric("mammoth_gateway_backends_serving", stage="ar") == 1)
            events = sse_events(lines)
            cm.__exit__(None, None, None)
            client.close()
            t_marked = marked.result()
        finally:
            busy.sigcont()
    assert t_marked is not None
    assert measured("sigstop_ar_marked_down", t_marked - t_stop) <= MARKED_DOWN_S
    assert events[-1]["event"] == "image_generation.completed", events[-3:]
    assert {e.get("epoch") for e in events if e.get("stage") == "ar"} == {0, 1}
    assert events[-1]["b64_json"] == expected


def test_sigterm_to_idle_stages_exits_within_2_s(cluster):
    dit = cluster.stage("dit", "--drain-grace-seconds", GRACE)
    ar = cluster.stage("ar", "--drain-grace-seconds", GRACE)
    gw = cluster.gateway([ar], [dit], health_interval=None)
    assert image_request(f"http://{gw.address}").status_code == 200  # channels open, then idle
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        t_term = time.monotonic()
        dit.sigterm()
        ar.sigterm()
        exits = [exited_at(pool, p) for p in (dit, ar)]
        (t_dit, dit_code), (t_ar, ar_code) = (f.result() for f in exits)
    assert (dit_code, ar_code) == (0, 0)
    assert measured("sigterm_idle_dit_exit", t_dit - t_term) <= IDLE_EXIT_S
    assert measured("sigterm_idle_ar_exit", t_ar - t_term) <= IDLE_EXIT_S


def test_sigterm_with_work_exits_within_1_s_of_the_last_request(cluster):
    dit = cluster.stage("dit", "--slots", "2", "--drain-grace-seconds", WORK_GRACE)
    ar = cluster.stage("ar", "--drain-grace-seconds", WORK_GRACE)
    gw = cluster.gateway([ar], [dit], health_interval=None)
    url = f"http://{gw.address}"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        requests = [pool.submit(timed_request, url, seed=i, size=BIG) for i in range(2)]
        assert wait_for(lambda: dit.metric("mammoth_dit_slots_in_use") == 2
                        and ar.metric("mammoth_ar_running_sequences") == 2, 20.0)
        t_term = time.monotonic()
        dit.sigterm()
        ar.sigterm()
        exits = [exited_at(pool, p, timeout=120.0) for p in (dit, ar)]
        answers = [f.result() for f in requests]
        (t_dit, dit_code), (t_ar, ar_code) = (f.result() for f in exits)
    assert [r.status_code for _, r in answers] == [200, 200]
    assert (dit_code, ar_code) == (0, 0)
    t_last = max(t for t, _ in answers)
    measured("sigterm_with_work_last_answer_after_term", t_last - t_term)
    assert measured("sigterm_with_work_dit_exit_after_last", t_dit - t_last) <= EXIT_AFTER_WORK_S
    assert measured("sigterm_with_work_ar_exit_after_last", t_ar - t_last) <= EXIT_AFTER_WORK_S


def test_requests_queued_behind_a_draining_only_dit_fail_fast_with_retry_after(cluster):
    dit = cluster.stage("dit", "--slots", "1", "--drain-grace-seconds", WORK_GRACE)
    ar = cluster.stage("ar")
    gw = cluster.gateway([ar], [dit], health_interval=None)
    url = f"http://{gw.address}"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        in_flight = pool.submit(timed_request, url, seed=1, size=BIG)
        assert wait_for(lambda: dit.metric("mammoth_dit_slots_in_use") == 1, 20.0)
        queued = pool.submit(timed_request, url, seed=2)
        assert wait_for(lambda: gw.metric("mammoth_gateway_queue_depth") == 1, 10.0)
        t_term = time.monotonic()
        dit.sigterm()
        t_queued, r = queued.result()
        _, done = in_flight.result()
    error = assert_envelope(r, (503,))
    assert error["code"] == "no_backend", error
    assert int(r.headers["retry-after"]) >= 1
    assert measured("draining_only_dit_queued_error", t_queued - t_term) <= FAILED_REQUEST_S
    assert done.status_code == 200  # the request it already held finishes
