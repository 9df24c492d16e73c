"""Refused stage calls leave a trace in the log, and a flood of them cannot flood it.

Found by a break-it pass (2026-12-03): eleven unauthenticated or wrong-token calls to the stages left
no log line at all, so an operator could not see them. Now each refusal is a WARNING naming the
method and the status, at most one per 10 s with the count suppressed since
(`mammoth_core.logging.RateLimitFilter`). A real `grpc.aio` server with the token interceptor.
"""

from __future__ import annotations

import asyncio
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


async def test_an_authenticated_request_that_does_not_parse_is_invalid_argument(caplog):
    """Found by a break-it pass (2026-12-03): garbage bytes with a valid token to ``AR.Generate``
    ended UNKNOWN ("Unexpected DecodeError") with an ERROR traceback in the stage's log. Now
    INVALID_ARGUMENT naming the parse error, no ERROR line, and the server keeps serving. The
    service is registered by the generated ``add_ARServicer_to_server``, as the AR stage does."""
    from mammoth_core.pb import mammoth_pb2 as pb
    from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc

    class Servicer(pb_grpc.ARServicer):
        async def Generate(self, request, context):
            yield pb.ARGenerateResponse(done=pb.ARDone(prompt_tokens=len(request.prompt)))

    server = grpc_common.create_server(1 << 20, "right-token")
    pb_grpc.add_ARServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    auth = grpc_common.auth_metadata("right-token")
    caplog.set_level(logging.WARNING)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            raw = ch.unary_stream("/mammoth.v1.AR/Generate", request_serializer=lambda b: b,
                                  response_deserializer=pb.ARGenerateResponse.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in raw(b"\xff\xff\xff\xff\x0f" * 100, metadata=auth, timeout=5):
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), err.value.details())
            assert "not a valid message" in err.value.details()
            good = [m async for m in pb_grpc.ARStub(ch).Generate(pb.ARGenerateRequest(prompt="abc"), metadata=auth,
                                                                 timeout=5)]
            assert good[0].done.prompt_tokens == 3  # still serving, and a valid request parses as before
    finally:
        await server.stop(0)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


async def test_health_watch_needs_a_token_check_stays_open():
    """Found by a break-it pass (2026-12-03): ``Health/Watch`` streams were open to anyone, and each
    holds its request (up to the message limit) for as long as the caller keeps it: 6,000 streams
    of 100 KB service names took a DiT from 485 MiB to 2,990 MiB, without a token. Now a stream
    needs a stage token (the gateway's monitor sends its own); ``Health/Check`` stays open for
    kubelet probes, which carry none."""
    server = grpc_common.create_server(1 << 20, None, role_tokens={grpc_common.ROLE_GATEWAY: "gw-token",
                                                                   grpc_common.ROLE_AR: "ar-token"})
    health = grpc_common.HealthReporter(server, ["mammoth.v1.DiT"])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set_serving()
    request = health_pb2.HealthCheckRequest(service="mammoth.v1.DiT")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            assert (await stub.Check(request, timeout=5)).status == health_pb2.HealthCheckResponse.SERVING
            for md in ((), grpc_common.auth_metadata("wrong")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Watch(request, metadata=md, timeout=5):
                        pass
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for token in ("gw-token", "ar-token"):
                watch = stub.Watch(request, metadata=grpc_common.auth_metadata(token), timeout=5)
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                watch.cancel()
    finally:
        await server.stop(0)


async def test_the_gateways_health_monitor_watches_with_its_token():
    """The gateway's `HealthMonitor` sends its stage token on the Watch stream, so a change reaches
    it at once (with the Watch refused it would only learn it from the next Check probe, here an
    hour away)."""
    from gateway.health import HealthMonitor

    server = grpc_common.create_server(1 << 20, None, role_tokens={grpc_common.ROLE_GATEWAY: "gw-token"})
    health = grpc_common.HealthReporter(server, ["mammoth.v1.DiT"])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set_serving()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            monitor = HealthMonitor(ch, "mammoth.v1.DiT", 3600.0, 5.0, lambda: None, "dit test",
                                    grpc_common.auth_metadata("gw-token"))
            monitor.start()
            try:
                for want in (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING):
                    if want == health_pb2.HealthCheckResponse.NOT_SERVING:
                        await health.set_all(want)
                    for _ in range(100):
                        if monitor.status == want:
                            break
                        await asyncio.sleep(0.02)
                    assert monitor.status == want
            finally:
                await monitor.stop()
    finally:
        await server.stop(0)
