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
                       refresh_seconds=0.2)
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
