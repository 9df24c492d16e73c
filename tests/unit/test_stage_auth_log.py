"""Refused stage calls leave a trace in the log, and a flood of them cannot flood it.

Found by a break-it pass (2026-12-03): eleven unauthenticated or wrong-token calls to the stages left
no log line at all, so an operator could not see them. Now each refusal is a WARNING naming the
method and the status, at most one per 10 s with the count suppressed since
(`mammoth_core.logging.RateLimitFilter`). A real `grpc.aio` server with the token interceptor.
"""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mammoth_core import grpc_common

STAGE_METHOD = "/mammoth.v1.DiT/Generate"


async def test_refused_calls_are_logged_once_per_interval(caplog):
    server = grpc_common.create_server(1 << 20, "right-token")
    health = grpc_common.HealthReporter(server, ["mammoth.v1.DiT"])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set_serving()
    # a handler for a stage method, so the call reaches the token check (an unknown method does not)
    handler = grpc.method_handlers_generic_handler("mammoth.v1.DiT", {
        "Generate": grpc.unary_unary_rpc_method_handler(lambda req, ctx: b"", lambda b: b, lambda b: b)})
    server.add_generic_rpc_handlers((handler,))
    caplog.set_level(logging.WARNING, logger="mammoth_core.grpc_common.auth")
    for limiter in grpc_common.auth_logger.filters:  # an earlier test's refusals must not hide this one's
        limiter.reset()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_unary(STAGE_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            for md in [()] * 20 + [grpc_common.auth_metadata("wrong")] * 20:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(b"", metadata=md, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
    lines = [r.getMessage() for r in caplog.records if r.name == "mammoth_core.grpc_common.auth"]
    assert len(lines) == 1, lines  # 40 refusals within the interval: one line
    assert STAGE_METHOD in lines[0] and "UNAUTHENTICATED" in lines[0]
