"""Thin HTTP routes; the logic lives in `gateway.serving` (vLLM's protocol/serving/api_router split).

Routes: ``POST /v1/images/generations``, ``GET /v1/images/files/{image_id}`` (``url`` responses),
``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /healthz``, ``GET /readyz``, ``GET /metrics``.
Every error is the OpenAI envelope (`gateway.errors.create_error_response`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any, Awaitable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from gateway.errors import AuthenticationError, ErrorResponse, NotFoundError
from gateway.protocol import ImageGenerationRequest, ImagesResponse, ModelCard, ModelList

router = APIRouter()

GENERATIONS_PATH = "/v1/images/generations"

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request (`param` names the field)"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model (`model_not_found`)"},
    429: {"model": ErrorResponse, "description": "Admission queue full (`Retry-After`)"},
    500: {"model": ErrorResponse, "description": "Internal error"},
    502: {"model": ErrorResponse, "description": "A stage failed after retries"},
    503: {"model": ErrorResponse, "description": "No serving backend or draining (`Retry-After`)"},
    504: {"model": ErrorResponse, "description": "The request's time budget ran out"},
}


#: One server-sent event of a ``stream: true`` answer: its ``event`` type and its ``data`` (one line
#: of JSON: the event object of docs/API.md, or ``{"error": ...}`` for ``error``).
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "enum": ["image_generation.progress",
                                             "image_generation.partial_image",
                                             "image_generation.completed", "error"]},
        "data": {"type": "string", "description": "JSON object of the event"},
    },
    "required": ["data"],
}


def key_of_line(line: str) -> str:
    """The key a line of the API-key file holds ('' for none): its first whitespace-separated word,
    unless that starts a comment. ``#`` starts a comment at the line's start or after whitespace
    only, so a key may contain ``#`` (cutting at any ``#`` turned ``sk-a#b`` into ``sk-a``, a weaker
    key, silently)."""
    words = line.split()
    return "" if not words or words[0].startswith("#") else words[0]


class ApiKeys:
    """API keys from a file (one per line, ``#`` comments: `key_of_line`), re-read when the file changes.

    With no file configured every request is allowed. A configured but empty or unreadable file
    allows nothing (fail closed).
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._mtime: float | None = None
        self._keys: frozenset[str] = frozenset()

    def _load(self) -> frozenset[str]:
        assert self.path is not None
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            self._mtime, self._keys = None, frozenset()
            return self._keys
        if mtime != self._mtime:
            with open(self.path, encoding="utf-8") as f:
                self._keys = frozenset(k for k in map(key_of_line, f) if k)
            self._mtime = mtime
        return self._keys

    def check(self, authorization: str | None) -> None:
        """Raise `AuthenticationError` unless ``authorization`` is ``Bearer <a listed key>``."""
        if not self.path:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthenticationError("missing API key: send 'Authorization: Bearer <key>'")
        if key.strip() not in self._load():
            raise AuthenticationError("incorrect API key provided")


async def require_api_key(request: Request) -> None:
    """Dependency of the ``/v1`` API routes (not of health, metrics or image URLs)."""
    request.app.state.api_keys.check(request.headers.get("authorization"))


async def _listen_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def with_cancellation(work: Awaitable[Any], request: Request) -> Any:
    """Await ``work``; if the HTTP client disconnects first, cancel it and return None."""
    handler = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_listen_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({handler, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not handler.done():
            handler.cancel()
    if handler in done:
        return handler.result()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await handler
    return None


@router.post(
    GENERATIONS_PATH,
    response_model=ImagesResponse,
    response_model_exclude_none=True,
    responses={
        **_ERRORS,
        200: {"description": "The images (JSON), or with `stream: true` server-sent events "
                             "(`image_generation.partial_image`, `image_generation.completed`, "
                             "`error`; `image_generation.progress` only with `stream_progress: "
                             "true`)",
              "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}},
    },
    dependencies=[Depends(require_api_key)],
    summary="Create images from a prompt (OpenAI images API)",
)
async def create_image(body: ImageGenerationRequest, request: Request) -> Response:
    """Generate ``n`` images; see docs/API.md for every field and extension."""
    serving = request.app.state.serving
    started = request.state.started
    response = await with_cancellation(
        serving.create_image(body, request, request.state.request_id), request)
    if response is None:
        serving.record("cancelled", started)
        return Response(status_code=499)
    if isinstance(response, JSONResponse):
        serving.record("success", started)
    return response


@router.get("/v1/images/files/{image_id}", response_class=Response,
            responses={200: {"description": "The image bytes",
                             "content": {f"image/{fmt}": {"schema": {"type": "string", "format": "binary"}}
                                         for fmt in ("png", "jpeg", "webp")}},
                       404: _ERRORS[404]},
            summary="Fetch an image of a `url` response (no API key: the id is the capability)")
async def get_image_file(image_id: str, request: Request) -> Response:
    item = request.app.state.store.get(image_id)
    if item is None:
        raise NotFoundError("image not found or expired", param="image_id", code="image_not_found")
    return Response(item.data, media_type=item.content_type,
                    headers={"cache-control": "private, max-age=60"})


@router.get("/v1/models", response_model=ModelList, dependencies=[Depends(require_api_key)],
            responses={401: _ERRORS[401]})
async def list_models(request: Request) -> ModelList:
    settings = request.app.state.settings
    return ModelList(data=[ModelCard(id=settings.model_name, created=request.app.state.created)])


@router.get("/v1/models/{model}", response_model=ModelCard,
            dependencies=[Depends(require_api_key)],
            responses={401: _ERRORS[401], 404: _ERRORS[404]})
async def retrieve_model(model: str, request: Request) -> ModelCard:
    settings = request.app.state.settings
    if model != settings.model_name:
        raise NotFoundError(f"the model '{model}' does not exist", param="model",
                            code="model_not_found")
    return ModelCard(id=settings.model_name, created=request.app.state.created)


@router.get("/healthz", summary="Liveness")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: 200 only with >= 1 AR and >= 1 DiT serving",
            responses={503: {"description": "not ready"}})
async def readyz(request: Request) -> JSONResponse:
    state = request.app.state
    serving = getattr(state, "serving", None)
    body: dict[str, Any] = {"draining": state.gateway_state.draining}
    ready = serving is not None and not state.gateway_state.draining
    for stage in ("ar", "dit"):
        pool = getattr(serving.engine, f"{stage}_pool") if serving is not None else None
        up = len(pool.serving()) if pool is not None else 0
        body[stage] = {"serving": up, "known": len(pool.backends) if pool is not None else 0}
        ready = ready and up >= 1
    body["status"] = "ready" if ready else "not_ready"
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text exposition format 0.0.4",
                             "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


# HEAD as GET (uvicorn sends no body for it): some load balancers' health checks send HEAD.
for _path, _endpoint in (("/healthz", healthz), ("/readyz", readyz), ("/metrics", metrics)):
    router.add_api_route(_path, _endpoint, methods=["HEAD"], include_in_schema=False)
