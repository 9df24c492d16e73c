"""gRPC plumbing shared by the AR and DiT stages (and their clients).

- `server_options` / `channel_options`: the same max send AND receive message size on both sides
  (``max_message_bytes``), so a message over the limit fails with RESOURCE_EXHAUSTED on whichever
  side sees it first instead of hanging; keepalive settings whose client ping period is longer than
  the server's minimum ping interval (a client pinging faster gets GOAWAY ``too_many_pings``).
- `TokenAuthInterceptor`: the stage-to-stage shared token, ``authorization: Bearer <token>``;
  every method except the ``grpc.health.v1.Health`` service answers UNAUTHENTICATED without it.
- `auth_metadata`: the matching client metadata.
- `HealthReporter`: ``grpc.health.v1`` servicer with a status per service name (``""`` and e.g.
  ``mammoth.v1.DiT``); `install_drain_handler` flips everything to NOT_SERVING on SIGTERM, refuses
  new work (`Drain.draining`) and stops the server with ``drain_grace_seconds`` of grace.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
from typing import Any, Awaitable, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

logger = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
AUTH_HEADER = "authorization"

# Keepalive (milliseconds). Clients ping an idle connection every 30 s and give up after 10 s
# without an answer; servers accept pings every 10 s or slower (so the client never trips
# ``too_many_pings``) and ping their own idle clients every 60 s.
CLIENT_KEEPALIVE_TIME_MS = 30_000
SERVER_KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 10_000
SERVER_MIN_PING_INTERVAL_MS = 10_000


def _message_limits(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", int(max_message_bytes)),
        ("grpc.max_receive_message_length", int(max_message_bytes)),
    ]


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Options for `grpc.aio.server`: message limits (bytes) and server-side keepalive."""
    return _message_limits(max_message_bytes) + [
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
    ]


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Options for `grpc.aio.insecure_channel`: message limits (bytes) and client keepalive."""
    return _message_limits(max_message_bytes) + [
        ("grpc.keepalive_time_ms", CLIENT_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 0),
    ]


def create_channel(target: str, max_message_bytes: int) -> grpc.aio.Channel:
    """An insecure `grpc.aio` channel to ``target`` (``host:port`` or ``dns:///name:port``)."""
    return grpc.aio.insecure_channel(target, options=channel_options(max_message_bytes))


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the stage token (empty when ``token`` is None or empty)."""
    if not token:
        return ()
    return ((AUTH_HEADER, f"Bearer {token}"),)


def _bearer(metadata: Iterable[Any] | None) -> str | None:
    for item in metadata or ():
        key, value = item[0], item[1]
        if key.lower() == AUTH_HEADER:
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, credential = value.partition(" ")
            if scheme.lower() == "bearer":
                return credential.strip()
            return None
    return None


def _abort_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str):
    """A handler of the same kind as ``handler`` that aborts with ``code``."""

    async def unary(request_or_iterator, context):
        await context.abort(code, details)

    async def streaming(request_or_iterator, context):
        await context.abort(code, details)
        yield  # pragma: no cover - makes this an async generator

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming)
    return grpc.unary_unary_rpc_method_handler(unary)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Require ``authorization: Bearer <token>`` on every RPC except the health service.

    Args:
        token: the shared stage token; None or empty disables the check (local mode).

    A missing or wrong token aborts the call with UNAUTHENTICATED (compared in constant time).
    """

    def __init__(self, token: str | None):
        self._token = token or None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if self._token is None or handler is None:
            return handler
        method = handler_call_details.method or ""
        if method.startswith(f"/{HEALTH_SERVICE}/"):
            return handler
        presented = _bearer(handler_call_details.invocation_metadata)
        if presented is not None and hmac.compare_digest(
            presented.encode(), self._token.encode()
        ):
            return handler
        return _abort_handler(handler, grpc.StatusCode.UNAUTHENTICATED, "missing or invalid stage token")


def create_server(
    max_message_bytes: int, auth_token: str | None, *, interceptors: Sequence[Any] = ()
) -> grpc.aio.Server:
    """A `grpc.aio.server` with the shared options and the token interceptor (when a token is set)."""
    chain = list(interceptors)
    if auth_token:
        chain.insert(0, TokenAuthInterceptor(auth_token))
    return grpc.aio.server(interceptors=chain, options=server_options(max_message_bytes))


class HealthReporter:
    """``grpc.health.v1`` health for one server, with a status per service name.

    Args:
        server: the `grpc.aio.Server` to add the health service to.
        services: service names reported (``""`` is always added), e.g. ``["mammoth.v1.DiT"]``.

    Every service starts NOT_SERVING; call `set_serving` once the model is loaded.
    """

    def __init__(self, server: grpc.aio.Server, services: Iterable[str]):
        self.servicer = HealthServicer()
        self.services = [""] + [s for s in services if s]
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        self.draining = False

    async def set_all(self, status: int) -> None:
        """Set every service to ``status`` (a `health_pb2.HealthCheckResponse` enum value)."""
        for name in self.services:
            await self.servicer.set(name, status)

    async def set_serving(self) -> None:
        """Report SERVING for every service (unless draining)."""
        if not self.draining:
            await self.set_all(health_pb2.HealthCheckResponse.SERVING)

    async def set_not_serving(self) -> None:
        """Report NOT_SERVING for every service."""
        await self.set_all(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for every service, permanently (later `set` calls are ignored)."""
        self.draining = True
        await self.servicer.enter_graceful_shutdown()


async def drain(
    server: grpc.aio.Server,
    health: HealthReporter,
    grace_seconds: float,
    wait_idle: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Report NOT_SERVING, wait (within ``grace_seconds``) for ``wait_idle`` -- in-flight work that
    still needs *new* RPCs, e.g. a DiT slot waiting for its ``PushConditions`` -- then stop the
    server: new RPCs are refused and in-flight ones get the rest of the grace before cancellation."""
    await health.enter_graceful_shutdown()
    logger.info("draining: NOT_SERVING, %.1f s grace for in-flight work", grace_seconds)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_seconds
    if wait_idle is not None:
        try:
            await asyncio.wait_for(wait_idle(), grace_seconds)
        except asyncio.TimeoutError:
            logger.warning("drain: in-flight work did not finish within %.1f s", grace_seconds)
    await server.stop(max(0.0, deadline - loop.time()))


def install_drain_handler(
    server: grpc.aio.Server,
    health: HealthReporter,
    grace_seconds: float,
    *,
    on_drain: Callable[[], None] | None = None,
    wait_idle: Callable[[], Awaitable[None]] | None = None,
    signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
) -> asyncio.Event:
    """On SIGTERM/SIGINT run `drain` once (``on_drain`` is called first, e.g. to refuse new work;
    ``wait_idle`` is awaited within the grace before the server stops).

    Returns an `asyncio.Event` set when the drain has finished (the server is stopped).
    Must be called from the running event loop's thread.
    """
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    started = False

    async def _run() -> None:
        try:
            await drain(server, health, grace_seconds, wait_idle)
        finally:
            done.set()

    def _on_signal() -> None:
        nonlocal started
        if started:
            return
        started = True
        if on_drain is not None:
            on_drain()
        loop.create_task(_run())

    for sig in signals:
        loop.add_signal_handler(sig, _on_signal)
    return done
