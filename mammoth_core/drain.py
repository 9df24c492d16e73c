"""SIGTERM drain of a stage's gRPC server: it ends with the work, the grace is only the bound.

On SIGTERM a stage reports NOT_SERVING on every health service, refuses new work (``on_drain``),
lets the work it has finish, and stops. *Work* is every RPC in flight except the health service
(`InFlightRpcs` counts them): the gateway's ``Health/Watch`` streams never end by themselves and
are not work, so an idle stage stops at once and a busy one as soon as its last RPC returned,
never later than ``drain_grace_seconds``. The server keeps accepting RPCs while it drains, since
in-flight work may still need new ones (a reserved DiT slot waits for its ``PushConditions``);
the servicers refuse new work themselves.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from typing import Any, Awaitable, Callable, Sequence

import grpc

from mammoth_core.grpc_common import HEALTH_SERVICE, HealthReporter

logger = logging.getLogger(__name__)

#: After the last RPC of work returned, the RPCs left (health watches, a status being flushed)
#: get this many seconds before the server cancels them.
STOP_TAIL_SECONDS = 0.2


class InFlightRpcs(grpc.aio.ServerInterceptor):
    """Server interceptor counting the RPCs in flight that are work (every method except the
    ``grpc.health.v1.Health`` service). Pass it to `mammoth_core.grpc_common.create_server`.

    `wait_idle` returns once none is in flight.
    """

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def _enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def _exit(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no RPC of work is in flight."""
        while self.count:
            await self._idle.wait()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or (handler_call_details.method or "").startswith(f"/{HEALTH_SERVICE}/"):
            return handler
        return self._counted(handler)

    def _counted(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` with its behaviour counted while it runs (the same serializers)."""
        codecs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}

        async def unary_response(request_or_iterator: Any, context: Any) -> Any:
            behaviour = handler.stream_unary if handler.request_streaming else handler.unary_unary
            self._enter()
            try:
                return await behaviour(request_or_iterator, context)
            finally:
                self._exit()

        async def stream_response(request_or_iterator: Any, context: Any):
            behaviour = handler.stream_stream if handler.request_streaming else handler.unary_stream
            self._enter()
            try:
                result = behaviour(request_or_iterator, context)
                if inspect.isasyncgen(result):
                    async for response in result:
                        yield response
                else:  # a coroutine writing through context.write
                    await result
            finally:
                self._exit()

        if handler.response_streaming:
            make = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                    else grpc.unary_stream_rpc_method_handler)
            return make(stream_response, **codecs)
        make = (grpc.stream_unary_rpc_method_handler if handler.request_streaming
                else grpc.unary_unary_rpc_method_handler)
        return make(unary_response, **codecs)


async def drain(
    server: grpc.aio.Server,
    health: HealthReporter,
    grace_seconds: float,
    wait_idle: Callable[[], Awaitable[None]] | None = None,
    in_flight: InFlightRpcs | None = None,
) -> None:
    """Report NOT_SERVING, wait for the work to end, then stop the server.

    Work has ended when ``wait_idle`` (stage-specific, e.g. the AR engine has no running sequence)
    returned and ``in_flight`` counts no RPC; both are awaited within ``grace_seconds``. The server
    then stops with `STOP_TAIL_SECONDS` of grace (or the grace left, when the work did not end in
    time): new RPCs are refused, the rest are cancelled after it.
    """
    await health.enter_graceful_shutdown()
    logger.info("draining: NOT_SERVING, at most %.1f s for in-flight work", grace_seconds)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_seconds
    finished = True
    try:
        async with asyncio.timeout(grace_seconds):
            while True:
                if wait_idle is not None:
                    await wait_idle()
                if in_flight is None or in_flight.count == 0:
                    break
                await in_flight.wait_idle()
    except TimeoutError:
        finished = False
        logger.warning("drain: in-flight work did not finish within %.1f s", grace_seconds)
    remaining = max(0.0, deadline - loop.time())
    await server.stop(min(STOP_TAIL_SECONDS, remaining) if finished else remaining)


def install_drain_handler(
    server: grpc.aio.Server,
    health: HealthReporter,
    grace_seconds: float,
    *,
    on_drain: Callable[[], None] | None = None,
    wait_idle: Callable[[], Awaitable[None]] | None = None,
    in_flight: InFlightRpcs | None = None,
    signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
) -> asyncio.Event:
    """On SIGTERM/SIGINT run `drain` once (``on_drain`` is called first, e.g. to refuse new work).

    Returns an `asyncio.Event` set when the drain has finished (the server is stopped).
    Must be called from the running event loop's thread.
    """
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    started = False

    async def _run() -> None:
        try:
            await drain(server, health, grace_seconds, wait_idle, in_flight)
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
