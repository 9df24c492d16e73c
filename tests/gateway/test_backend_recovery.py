"""`BackendPool.mark_failed` takes a backend out of rotation only until its health answers again.

Regression: a ``Health/Watch`` stream only speaks on a change, so a backend marked failed after one
bad call (e.g. an AR whose push failed because the *DiT* died) stayed out of rotation for good while
its server kept reporting SERVING; every later request then got 503 ``no_backend``.
"""

from __future__ import annotations

import asyncio

from gateway.backends import BackendPool
from gateway.metrics import GatewayMetrics
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc


async def test_marked_failed_backend_returns_when_its_health_is_serving(fakes):
    ar = fakes("ar")
    pool = BackendPool("ar", [ar.address], "mammoth.v1.AR", pb_grpc.ARStub, GatewayMetrics(),
                       refresh_seconds=0.2, probe_timeout_seconds=1.0)
    await pool.start()
    try:
        for _ in range(100):
            if pool.serving():
                break
            await asyncio.sleep(0.02)
        (backend,) = pool.serving()
        pool.mark_failed(backend)
        assert pool.serving() == []  # out of rotation at once ...
        for _ in range(100):
            if pool.serving():
                break
            await asyncio.sleep(0.02)
        assert pool.serving() == [backend]  # ... and back once health says SERVING again
        # a dead backend stays out
        ar.kill()
        pool.mark_failed(backend)
        await asyncio.sleep(0.6)
        assert pool.serving() == []
    finally:
        await pool.close()


async def _until(predicate, timeout: float) -> float | None:
    """Seconds until ``predicate()`` held (polled every 10 ms), or None after ``timeout``."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while loop.time() - start < timeout:
        if predicate():
            return loop.time() - start
        await asyncio.sleep(0.01)
    return None


async def test_a_stopped_backend_is_marked_down_within_interval_plus_probe_deadline(fakes):
    """SIGSTOP keeps the connection open and the Watch stream silent: only a health check with a
    deadline notices. Interval 0.5 s + probe deadline 0.5 s: down within about 1 s, hung after the
    second probe in a row without an answer, back after SIGCONT."""
    import signal

    ar = fakes("ar")
    pool = BackendPool("ar", [ar.address], "mammoth.v1.AR", pb_grpc.ARStub, GatewayMetrics(),
                       refresh_seconds=0.5, probe_timeout_seconds=0.5)
    await pool.start()
    try:
        assert await _until(lambda: pool.serving(), 5.0) is not None
        (backend,) = pool.serving()
        ar.proc.send_signal(signal.SIGSTOP)
        try:
            took = await _until(lambda: not pool.serving(), 3.0)
            assert took is not None and took <= 1.0 + 0.3, took
            assert await _until(backend.health.hung.is_set, 0.5 + 0.3) is not None
            assert not pool.available()
        finally:
            ar.proc.send_signal(signal.SIGCONT)
        assert await _until(lambda: pool.serving() == [backend], 3.0) is not None
        assert not backend.health.hung.is_set()
    finally:
        await pool.close()


async def test_marked_failed_backend_is_available_while_probed_and_a_dead_one_is_not(fakes):
    """After one failed call the backend is out of rotation but still *available* (a probe is
    under way), so a request waits for it instead of failing; a killed backend answers the probe
    with a refused connection and is unavailable within milliseconds."""
    ar = fakes("ar")
    pool = BackendPool("ar", [ar.address], "mammoth.v1.AR", pb_grpc.ARStub, GatewayMetrics(),
                       refresh_seconds=2.0, probe_timeout_seconds=1.0)
    await pool.start()
    try:
        assert await _until(lambda: pool.serving(), 5.0) is not None
        (backend,) = pool.serving()
        pool.mark_failed(backend)
        assert pool.serving() == [] and pool.available()
        assert await _until(lambda: pool.serving() == [backend], 1.0) is not None
        ar.kill()
        pool.mark_failed(backend)
        took = await _until(lambda: not pool.available(), 2.0)
        assert took is not None and took < 0.5, took
    finally:
        await pool.close()
