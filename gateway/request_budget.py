"""The time budget of one HTTP request: the gateway's limit, or less when the client says so.

The official ``openai`` SDKs send their client-side timeout with every request as
``X-Stainless-Read-Timeout: <seconds>`` (a float). A non-streaming answer sends nothing until the
image is done, so the client gives up after that many seconds; the gateway takes the header as the
request's deadline (less `CLIENT_MARGIN_SECONDS`, so the client reads a 504 ``deadline_exceeded``
instead of timing out, and the stages stop at once). A stream sends a keep-alive comment at least
every half of the client's read timeout instead. Values that are not finite positive numbers are
ignored; the gateway's own ``request_timeout_seconds`` is always the upper bound.
"""

from __future__ import annotations

import math
from typing import Mapping

CLIENT_TIMEOUT_HEADER = "x-stainless-read-timeout"
CLIENT_MARGIN_SECONDS = 0.25
MIN_BUDGET_SECONDS = 0.1


def client_timeout(headers: Mapping[str, str]) -> float | None:
    """The client's read timeout in seconds (`CLIENT_TIMEOUT_HEADER`), or None when absent/invalid."""
    raw = headers.get(CLIENT_TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def request_budget(headers: Mapping[str, str], limit: float, stream: bool) -> float:
    """Seconds the request may take: ``limit`` (``request_timeout_seconds``), capped for a
    non-streaming request by the client's timeout less `CLIENT_MARGIN_SECONDS`."""
    timeout = client_timeout(headers)
    if timeout is None or stream:
        return limit
    return min(limit, max(MIN_BUDGET_SECONDS, timeout - CLIENT_MARGIN_SECONDS))


def keepalive_interval(headers: Mapping[str, str], default: float) -> float:
    """Seconds between SSE keep-alive comments: ``default``, or half the client's read timeout
    when that is shorter (at least 0.5 s)."""
    timeout = client_timeout(headers)
    if timeout is None:
        return default
    return min(default, max(0.5, timeout / 2))
