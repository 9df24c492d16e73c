"""A stage's gRPC server bounds the connections a client can hold without doing any work.

Found by a break-it pass (2026-12-03): 300 plain TCP connections each to the AR and DiT ports, sending
nothing, were all still open 15 s later (the gateway closes its idle ones). Now a connection that
has not finished the HTTP/2 handshake within `SERVER_HANDSHAKE_TIMEOUT_MS` is closed, a connection
with no call for `MAX_CONNECTION_IDLE_MS` is sent away, and at most `MAX_INCOMING_CONNECTIONS` are
accepted. These tests run a real `grpc.aio` server from `mammoth_core.grpc_common.create_server`
with the limits shortened (the production values are minutes and hundreds).
"""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mammoth_core import grpc_common


def _open_silent(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.settimeout(0.2)
    return s


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(1024) == b""
    except socket.timeout:
        return False
    except OSError:  # reset
        return True


async def _serve(monkeypatch, **limits):
    for name, value in limits.items():
        monkeypatch.setattr(grpc_common, name, value)
    server = grpc_common.create_server(1 << 20, None, insecure=True)
    health = grpc_common.HealthReporter(server, ["mammoth.v1.Test"])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set_serving()
    return server, port


async def test_silent_connections_are_closed_after_the_handshake_timeout(monkeypatch):
    server, port = await _serve(monkeypatch, SERVER_HANDSHAKE_TIMEOUT_MS=1000)
    try:
        silent = [_open_silent(port) for _ in range(5)]
        t0 = time.monotonic()
        while not all(_closed(s) for s in silent):
            assert time.monotonic() - t0 < 8, "silent connections still open"
            await asyncio.sleep(0.1)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:  # a real client still gets in
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for s in silent:
            s.close()
        await server.stop(0)


def test_the_limits_are_in_every_stage_servers_options():
    options = dict(grpc_common.server_options(1 << 20))
    assert options["grpc.server_handshake_timeout_ms"] == grpc_common.SERVER_HANDSHAKE_TIMEOUT_MS <= 30_000
    assert options["grpc.max_connection_idle_ms"] == grpc_common.MAX_CONNECTION_IDLE_MS
    assert options["grpc.max_allowed_incoming_connections"] == grpc_common.MAX_INCOMING_CONNECTIONS
