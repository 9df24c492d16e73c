"""The gateway application: `build_app` (FastAPI factory) and `serve` (uvicorn with graceful drain).

`serve` runs until SIGTERM/SIGINT. On the first signal the gateway drains: ``/readyz`` answers 503
and new image requests get 503 ``draining`` (``Retry-After``) while requests in flight finish,
for at most ``drain_grace_seconds``; then uvicorn closes the connections and `serve` returns
(exit 0). A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api_router import GENERATIONS_PATH, ApiKeys, router
from gateway.backends import BackendPool, format_address
from gateway.errors import GatewayError, InvalidRequestError, PayloadTooLargeError, create_error_response, outcome_of
from gateway.images_store import ImageStore
from gateway.metrics import GatewayMetrics
from gateway.admission import GatewayState
from gateway.engine_client import EngineClient
from gateway.image_job import new_request_id
from gateway.serving import OpenAIServingImages
from gateway.slow_clients import guarded_protocol, quiet_logs
from mammoth_core import grpc_common, tracing
from mammoth_core.logging import request_id_var
from mammoth_core.pb import mammoth_pb2_grpc as pb_grpc
from mammoth_core.runtime import listen_sockets, write_ready_file
from mammoth_core.settings import GatewaySettings

logger = logging.getLogger(__name__)

AR_SERVICE = "mammoth.v1.AR"
DIT_SERVICE = "mammoth.v1.DiT"


class RequestIdMiddleware:
    """Gives every HTTP request an id (client's ``x-request-id`` if well formed) and start time,
    adds ``x-request-id`` to every response, and sets `mammoth_core.logging.request_id_var` for the
    request's task (every log line about it carries the id; the stages log ``<id>-<image index>``).

    With tracing on (`mammoth_core.tracing`), requests under ``/v1/`` get a SERVER span (continuing
    the client's ``traceparent`` header when it sends one), current while the app handles them.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        raw = headers.get(b"x-request-id")
        request_id = new_request_id(raw.decode("latin-1") if raw else None)
        scope.setdefault("state", {})
        scope["state"]["request_id"] = request_id
        scope["state"]["started"] = time.perf_counter()
        traced = tracing.enabled() and scope.get("path", "").startswith("/v1/")
        span_cm = _request_span(scope, headers, request_id) if traced else contextlib.nullcontext()
        span = None

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                hdrs = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                hdrs.append((b"x-request-id", request_id.encode()))
                message = {**message, "headers": hdrs}
                if span is not None:
                    span.set_attribute("http.response.status_code", message.get("status", 0))
            await send(message)

        token = request_id_var.set(request_id)
        try:
            with span_cm as span:
                await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)


def _request_span(scope: Scope, headers: dict[bytes, bytes], request_id: str):
    """The SERVER span of one HTTP request (`tracing.span`): named ``METHOD /path`` (image ids
    collapsed), child of the client's ``traceparent`` when it sent one."""
    path = scope.get("path", "")
    route = "/v1/images/files/{image_id}" if path.startswith("/v1/images/files/") else path
    method = scope.get("method", "GET")
    parent = tracing.extract([(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers.items()
                              if k in (b"traceparent", b"tracestate")])
    return tracing.span(f"{method} {route}", parent, kind="SERVER",
                        attributes={"http.request.method": method, "url.path": path,
                                    "mammoth.request_id": request_id})


class BodySizeLimitMiddleware:
    """Refuses request bodies larger than ``max_bytes`` with 413 (OpenAI envelope) before the app
    reads them: a ``Content-Length`` over the limit is refused at once; a chunked body is read here,
    counted, and handed on only when it fits (so nothing upstream ever buffers an unbounded body).

    A request with both ``Content-Length`` and ``Transfer-Encoding`` is refused with 400
    ``invalid_http_request`` and ``Connection: close`` before its body is read: the server framed
    its body by the chunks while the length said otherwise (RFC 9112 §6.3: possible request
    smuggling; the connection must close after the answer)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, scope: Scope, send: Send) -> None:
        request_id = (scope.get("state") or {}).get("request_id")
        response = create_error_response(PayloadTooLargeError(
            f"request body is larger than {self.max_bytes} bytes", code="request_too_large"), request_id)
        await response(scope, _no_receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and b"transfer-encoding" in headers:
            response = create_error_response(InvalidRequestError(
                "a request may not carry both Content-Length and Transfer-Encoding",
                code="invalid_http_request"), (scope.get("state") or {}).get("request_id"))
            response.headers["connection"] = "close"
            await response(scope, _no_receive, send)
            return
        if length is not None:
            if not length.strip().isdigit() or int(length) > self.max_bytes:
                await self._refuse(scope, send)
                return
            await self.app(scope, receive, send)
            return
        if b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client gone
                return
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                await self._refuse(scope, send)
                return
            chunks.append(body)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _no_receive() -> Message:  # pragma: no cover - a JSONResponse never reads the request
    return {"type": "http.disconnect"}


def _channel_options(settings: GatewaySettings) -> list[tuple[str, Any]]:
    """Message limits and keepalive matching the stage servers (`mammoth_core.grpc_common`), and
    the name checked in the stages' TLS certificates (``tls_server_name``)."""
    options = grpc_common.channel_options(settings.max_message_bytes)
    if settings.tls_ca_file and settings.tls_server_name:
        options.append(("grpc.ssl_target_name_override", settings.tls_server_name))
    return options


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document, without FastAPI's 422 responses (validation answers 400)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description,
                         routes=app.routes)
    for path in schema.get("paths", {}).values():
        for op in path.values():
            op.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)
    schema.setdefault("components", {}).setdefault("securitySchemes", {})["bearerAuth"] = {
        "type": "http", "scheme": "bearer",
        "description": "API key (required only when the gateway has `api_keys_file`)"}
    app.openapi_schema = schema
    return schema


def _lifespan(settings: GatewaySettings, metrics: GatewayMetrics, store: ImageStore):
    """The app's lifespan: backend pools (discovery and health watches), the engine client with
    the stage token, ``app.state.serving`` and the image-store sweeper; all stopped on exit."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.gateway_state = GatewayState()
        credentials = settings.grpc_channel_credentials()
        token = settings.client_token(grpc_common.ROLE_GATEWAY)
        ar_pool, dit_pool = (
            BackendPool(stage, targets, service, stub, metrics, settings.health_interval_seconds,
                        _channel_options(settings), credentials,
                        probe_timeout_seconds=settings.health_timeout_seconds,
                        call_metadata=grpc_common.auth_metadata(token))
            for stage, targets, service, stub in (("ar", settings.ar, AR_SERVICE, pb_grpc.ARStub),
                                                  ("dit", settings.dit, DIT_SERVICE,
                                                   pb_grpc.DiTStub)))
        await ar_pool.start()
        await dit_pool.start()
        engine = EngineClient(settings, ar_pool, dit_pool, metrics, token)
        app.state.serving = OpenAIServingImages(settings, engine, store, metrics,
                                                app.state.gateway_state)
        sweeper = asyncio.create_task(store.run_sweeper())
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            await ar_pool.close()
            await dit_pool.close()
            store.clear()

    return lifespan


async def _handle_error(request: Request, exc: Exception):
    """Every error as the OpenAI envelope; a failed image request is counted by its outcome."""
    if request.url.path == GENERATIONS_PATH and request.method == "POST":
        serving = getattr(request.app.state, "serving", None)
        if serving is not None:
            serving.record(outcome_of(exc), getattr(request.state, "started", time.perf_counter()))
    return create_error_response(exc, getattr(request.state, "request_id", None))


def build_app(settings: GatewaySettings) -> FastAPI:
    """The gateway FastAPI app for ``settings``.

    Backend pools (discovery and health watches), the stage auth token and the image-store sweeper
    start in the app's lifespan, so the app must run under an ASGI server with lifespan enabled.
    ``app.state`` holds ``settings``, ``metrics`` (`GatewayMetrics`), ``store`` (`ImageStore`),
    ``gateway_state`` (`GatewayState`: ``draining``) and, once started, ``serving``.
    """
    metrics = GatewayMetrics()

    def on_store_change(count: int, size: int) -> None:
        metrics.stored_images.set(count)
        metrics.stored_image_bytes.set(size)

    store = ImageStore(settings.image_ttl_seconds,
                       max_bytes=int(getattr(settings, "image_store_max_bytes", 1 << 30)),
                       on_change=on_store_change)

    lifespan = _lifespan(settings, metrics, store)
    app = FastAPI(
        title="Mammoth Pipeline gateway",
        version="0.1.0",
        description="OpenAI-compatible images API serving MammothModa2 as a disaggregated AR -> "
                    "DiT pipeline. See docs/API.md.",
        lifespan=lifespan,
        # No 307 to the slash-less path: Starlette builds its Location from the Host header.
        redirect_slashes=False,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.store = store
    app.state.api_keys = ApiKeys(settings.api_keys_file)
    app.state.created = int(time.time())
    app.state.gateway_state = GatewayState()

    for exc_class in (Exception, RequestValidationError, StarletteHTTPException, GatewayError):
        app.add_exception_handler(exc_class, _handle_error)
    app.include_router(router)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestIdMiddleware)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (`serve` drains first)."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]
        yield


async def serve(settings: GatewaySettings, ready_file: str | None = None) -> None:
    """Serve the gateway on ``settings.host:settings.port`` until SIGTERM/SIGINT, then drain.

    Args:
        settings: gateway settings (``port`` 0 picks a free port).
        ready_file: written (`mammoth_core.runtime.write_ready_file`, ``{"address": "host:port"}``)
            once the socket listens and at least one AR and one DiT are SERVING.

    Raises:
        mammoth_core.runtime.StageStartError: ``host:port`` cannot be listened on (in use, not this
            machine's), before anything else starts.
    """
    tracing.setup("gateway", settings.trace_export, settings.trace_sample_ratio)
    app = build_app(settings)
    quiet_logs()
    protocol = guarded_protocol(settings.header_timeout_seconds, settings.body_timeout_seconds,
                                settings.max_connections, app.state.metrics.registry,
                                send_timeout=settings.send_timeout_seconds)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, lifespan="on",
                            log_config=None, access_log=False, timeout_graceful_shutdown=5,
                            timeout_keep_alive=5, http=protocol)
    server = _Server(config)
    socks = listen_sockets(settings.host, settings.port)  # a port in use: one line (`cannot_listen`), not uvicorn's exit
    loop = asyncio.get_running_loop()
    drain_task: asyncio.Task | None = None

    async def drain() -> None:
        state: GatewayState = app.state.gateway_state
        state.draining = True
        logger.info("draining: %d request(s) in flight, grace %.0fs", state.active,
                    settings.drain_grace_seconds)
        if state.active:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(state.idle.wait(), settings.drain_grace_seconds)
        server.should_exit = True

    def on_signal(sig: int) -> None:
        nonlocal drain_task
        if drain_task is None:
            logger.info("received %s", signal.Signals(sig).name)
            drain_task = loop.create_task(drain())
        else:
            server.force_exit = True
            server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, on_signal, sig)
    serve_task = asyncio.create_task(server.serve(sockets=socks))
    try:
        while not server.started and not serve_task.done():
            await asyncio.sleep(0.02)
        if server.started:
            host, port = server.servers[0].sockets[0].getsockname()[:2]
            logger.info("gateway listening on http://%s:%d", host, port)
            if ready_file:
                await _wait_backends_ready(app, serve_task)
                write_ready_file(ready_file, format_address(settings.host, port))
        await serve_task
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)
        tracing.shutdown()


async def _wait_backends_ready(app: FastAPI, serve_task: asyncio.Task) -> None:
    """Return once >= 1 AR and >= 1 DiT are SERVING (or the server stopped)."""
    while not serve_task.done():
        serving = getattr(app.state, "serving", None)
        if serving is not None and serving.engine.ar_pool.serving() \
                and serving.engine.dit_pool.serving():
            return
        await asyncio.sleep(0.05)
