"""The OpenAI error envelope and the one function that turns any exception into it.

Every error the gateway answers has the body ``{"error": {"message", "type", "param", "code"}}``
(OpenAI's envelope; vLLM's ``ErrorResponse{error: ErrorInfo}``), never FastAPI's ``{"detail": ...}``
and never a 422. `create_error_response` maps exception classes to HTTP status codes:

==============================  ======  =========================  ==========================
exception                       status  ``type``                   ``code``
==============================  ======  =========================  ==========================
`InvalidRequestError`           400     ``invalid_request_error``  per case (e.g. ``invalid_size``)
pydantic / FastAPI validation   400     ``invalid_request_error``  ``invalid_value`` or the rule's
`AuthenticationError`           401     ``authentication_error``   ``invalid_api_key``
`NotFoundError`                 404     ``invalid_request_error``  ``model_not_found`` / ``not_found``
`OverloadedError`               429     ``rate_limit_error``       ``queue_full`` (+ Retry-After)
`UnavailableError`              503     ``service_unavailable``    ``no_backend`` / ``draining`` (+ Retry-After)
`PayloadTooLargeError`          413     ``invalid_request_error``  ``request_too_large``
`DeadlineExceededError`         504     ``timeout``                ``deadline_exceeded``
`BackendError`                  502     ``backend_error``          ``backend_failure``
anything else                   500     ``server_error``           ``internal_error``
==============================  ======  =========================  ==========================
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Mapping

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class ErrorInfo(BaseModel):
    """Body of an OpenAI error: ``message``, ``type``, ``param`` (the offending field), ``code``."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error envelope ``{"error": ErrorInfo}``."""

    error: ErrorInfo


class GatewayError(Exception):
    """Base class of every error the gateway answers on purpose.

    Attributes:
        status_code: HTTP status.
        type: OpenAI error ``type``.
        code: OpenAI error ``code``.
        param: the request field at fault, or None.
        retry_after: seconds for a ``Retry-After`` header, or None.
        outcome: label value of the ``outcome`` metric.
    """

    status_code = 500
    type = "server_error"
    code = "internal_error"
    outcome = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after


class InvalidRequestError(GatewayError):
    """The request is invalid (HTTP 400); ``param`` names the field."""

    status_code = 400
    type = "invalid_request_error"
    code = "invalid_value"
    outcome = "invalid_request"


class AuthenticationError(GatewayError):
    """Missing or wrong API key (HTTP 401)."""

    status_code = 401
    type = "authentication_error"
    code = "invalid_api_key"
    outcome = "auth_error"


class NotFoundError(GatewayError):
    """Unknown model, expired image URL or unknown route (HTTP 404)."""

    status_code = 404
    type = "invalid_request_error"
    code = "not_found"
    outcome = "not_found"


class OverloadedError(GatewayError):
    """The admission queue is full (HTTP 429 with ``Retry-After``)."""

    status_code = 429
    type = "rate_limit_error"
    code = "queue_full"
    outcome = "overloaded"


class UnavailableError(GatewayError):
    """No serving backend of a stage, or the gateway is draining (HTTP 503 with ``Retry-After``)."""

    status_code = 503
    type = "service_unavailable"
    code = "no_backend"
    outcome = "unavailable"


class DeadlineExceededError(GatewayError):
    """The request's time budget ran out (HTTP 504)."""

    status_code = 504
    type = "timeout"
    code = "deadline_exceeded"
    outcome = "deadline"


class PayloadTooLargeError(GatewayError):
    """The request body is larger than the gateway's ``max_body_bytes`` (HTTP 413)."""

    status_code = 413
    type = "invalid_request_error"
    code = "request_too_large"
    outcome = "invalid_request"


class BackendError(GatewayError):
    """A stage failed and retries within the deadline did not help (HTTP 502)."""

    status_code = 502
    type = "backend_error"
    code = "backend_failure"
    outcome = "backend_error"


def _field_path(loc: tuple[Any, ...]) -> list[Any]:
    """``loc`` without its request part and an ``extra_body`` wrapper: ``("body", "extra_body",
    "dit_cache", "threshold")`` -> ``["dit_cache", "threshold"]``."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    if parts and parts[0] == "extra_body" and len(parts) > 1:
        parts = parts[1:]
    return parts


def _validation_param(loc: tuple[Any, ...]) -> str | None:
    """``("body", "size")`` -> ``"size"``; ``("body", "cfg_range", 0)`` -> ``"cfg_range"``."""
    parts = [str(p) for p in _field_path(loc) if not str(p).isdigit()]
    return parts[0] if parts else None


def _missing_part(loc: tuple[Any, ...]) -> str:
    """What lies below the named field in ``loc``: ``("body", "cfg_range", 1)`` -> ``"item 1"``,
    ``("body", "dit_cache", "threshold")`` -> ``"'threshold'"``, ``("body", "prompt")`` -> ``""``."""
    inner = _field_path(loc)[1:]
    return ".".join(f"item {p}" if isinstance(p, int) else f"'{p}'" for p in inner)


def _json_error_position(error: Mapping[str, Any]) -> str:
    """``"Expecting value at character 15"`` from a ``json_invalid`` validation error."""
    loc = tuple(error.get("loc", ()))
    why = (error.get("ctx") or {}).get("error") or error.get("msg", "JSON decode error")
    position = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
    return f"{why} at character {position} (counted from 0)" if position is not None else str(why)


def _is_json_object(data: Any) -> bool:
    """True when ``data`` (a body FastAPI did not parse: not sent as JSON) holds a JSON object."""
    if not isinstance(data, (bytes, str)):
        return False
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:
        return False


def _validation_info(exc: RequestValidationError | ValidationError
                     ) -> tuple[int, ErrorInfo, dict[str, str]]:
    """`error_info` of a pydantic / FastAPI validation error: the 400 naming the field (a request
    rule's ``param`` and ``code``, `gateway.protocol.rule_error`), or ``invalid_json``."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    param = _validation_param(loc)
    msg = first.get("msg", "invalid request")
    rule = first.get("ctx") or {}
    if "param" in rule and "message" in rule:  # a request rule (`gateway.protocol.rule_error`)
        return 400, ErrorInfo(message=str(rule["message"]), type="invalid_request_error",
                              param=str(rule["param"]), code=first.get("type")), {}
    if first.get("type") == "json_invalid":
        return 400, ErrorInfo(
            message=f"request body is not valid JSON: {_json_error_position(first)}",
            type="invalid_request_error",
            code="invalid_json",
        ), {}
    if first.get("type") == "missing" and param is None:
        # the body itself is missing (empty request body)
        return 400, ErrorInfo(
            message="the request body is empty: send a JSON object such as {\"prompt\": \"...\"} "
                    "with content-type application/json",
            type="invalid_request_error",
            code="invalid_json",
        ), {}
    if first.get("type") in ("dict_type", "model_type", "model_attributes_type") and param is None:
        if _is_json_object(first.get("input")):
            return 400, ErrorInfo(
                message="the request body is a JSON object but was not sent as JSON: add the header "
                        "content-type: application/json (curl -d alone sends "
                        "application/x-www-form-urlencoded)",
                type="invalid_request_error",
                code="invalid_json",
            ), {}
        return 400, ErrorInfo(
            message=f"the request body must be a JSON object (content-type application/json): {msg}",
            type="invalid_request_error",
            code="invalid_json",
        ), {}
    inner = _missing_part(loc)
    if first.get("type") == "missing" and inner:  # the field was sent; an element/key of it is absent
        text = f"invalid value for '{param}': {inner} is missing"
        code = "invalid_value"
    elif first.get("type") == "missing":
        text = f"missing required parameter: '{param}'"
        code = "missing_required_parameter"
    else:
        text = f"invalid value for '{param}': {msg}" if param else msg
        code = "invalid_value"
    return 400, ErrorInfo(message=text, type="invalid_request_error", param=param, code=code), {}


def error_info(exc: BaseException) -> tuple[int, ErrorInfo, dict[str, str]]:
    """Status, envelope body and extra headers for ``exc`` (see the module table)."""
    headers: dict[str, str] = {}
    if isinstance(exc, GatewayError):
        if exc.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
        if isinstance(exc, AuthenticationError):
            headers["WWW-Authenticate"] = "Bearer"
        info = ErrorInfo(message=exc.message, type=exc.type, param=exc.param, code=exc.code)
        return exc.status_code, info, headers
    if isinstance(exc, (RequestValidationError, ValidationError)):
        return _validation_info(exc)
    if isinstance(exc, StarletteHTTPException):
        status = exc.status_code
        if status == 400:  # FastAPI could not parse the body (e.g. JSON nested too deeply)
            info = ErrorInfo(message=f"request body is not valid JSON: {exc.detail}",
                             type="invalid_request_error", code="invalid_json")
        elif status == 404:
            info = ErrorInfo(message="not found", type="invalid_request_error", code="not_found")
        elif status == 405:
            info = ErrorInfo(message="method not allowed", type="invalid_request_error",
                             code="method_not_allowed")
        else:
            info = ErrorInfo(message=str(exc.detail), type="invalid_request_error" if status < 500
                             else "server_error", code=None)
        return status, info, dict(exc.headers or {})
    logger.exception("internal error", exc_info=exc)
    return 500, ErrorInfo(
        message=f"internal error: {type(exc).__name__}", type="server_error", code="internal_error"
    ), headers


def create_error_response(exc: BaseException, request_id: str | None = None) -> JSONResponse:
    """The OpenAI error envelope for any exception, with its status code and headers.

    Args:
        exc: any exception; `GatewayError` subclasses keep their status, request validation errors
            become 400 ``invalid_request_error`` naming the field, everything else 500.
        request_id: added as the ``x-request-id`` header when given.
    """
    status, info, headers = error_info(exc)
    if request_id:
        headers["x-request-id"] = request_id
    return _AsciiJSONResponse(ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message may quote the client's text, and
    a lone surrogate in it cannot be encoded as UTF-8 (the render would fail after the status line)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def outcome_of(exc: BaseException) -> str:
    """The ``outcome`` metric label for an exception (``internal_error`` when unknown)."""
    if isinstance(exc, GatewayError):
        return exc.outcome
    if isinstance(exc, (RequestValidationError, ValidationError)):
        return "invalid_request"
    if isinstance(exc, StarletteHTTPException) and exc.status_code < 500:
        return "not_found" if exc.status_code == 404 else "invalid_request"
    return "internal_error"
