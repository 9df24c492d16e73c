"""Bounds on what a slow or abusive HTTP client can hold: read deadlines, a connection cap, quiet logs.

uvicorn (0.54, h11) times out only idle kept-alive connections (``timeout_keep_alive``); a client that
sends its request head or body a byte at a time holds its connection forever, and
``limit_concurrency`` counts those connections too (normal requests get 503). `guarded_protocol`
returns uvicorn's h11 protocol with, per connection:

- a **header deadline**: the request head (request line and headers) must be complete within
  ``header_timeout`` seconds of the connection opening or of the previous response ending;
  otherwise the gateway answers ``408`` (OpenAI envelope, ``code: request_timeout``) and closes the
  connection;
- a **body deadline**: the body must be complete within ``body_timeout`` seconds of its head;
  otherwise the same ``408`` unless a response has begun, and the connection is closed (the request
  handler sees a disconnect and cancels its work);
- a **send deadline**: a client that stops reading its response (the transport's write buffer
  above its high-water mark, 64 KiB, so the response waits) must read again within
  ``send_timeout`` seconds; otherwise the connection is aborted, the unread bytes dropped (a close
  would wait for them forever) and the handler sees a disconnect. Before, a client that pipelined
  requests and read nothing held its connection, and the responses in memory, for good;
- a **connection cap**: at most ``max_connections`` open connections, and never more than the
  process's open-file limit minus `FD_HEADROOM` (gRPC channels, logs). A connection over the cap
  first evicts the connection stalled longest, at least `EVICT_AFTER_S`: one waiting for its
  request head (a stalled head, or an idle kept-alive connection) or body gets the ``408`` and is
  closed, one whose client stopped reading is aborted. So slow clients filling the cap cannot lock
  out new requests (the kubelet's ``/healthz`` probe among them), whichever phase they stall in
  (before, only stalled heads could be evicted: a break-it pass held the cap for 30 s with bodies
  announced and never sent, and for good with clients that read nothing). With none to evict it is
  answered ``503`` (OpenAI envelope, ``code: too_many_connections``, ``Retry-After``) and closed
  before anything is read, so the listening socket never runs out of file descriptors;
- bytes that are not an HTTP/1.1 request get ``400 invalid_http_request``, a request head larger
  than h11's limit (16 KiB) ``431 request_header_too_large``, both in the envelope (uvicorn's own
  answer is plain text), and the connection lingers `LINGER_SECONDS` so the client can read it.

While a handler runs and its client reads (the response phase) no deadline applies: image
generation has its own request budget. `quiet_logs` rate-limits the log records a flood can repeat (asyncio's
``socket.accept() out of system resource``, uvicorn's ``Invalid HTTP request received``, the
closes above): each distinct message at most once per `LOG_INTERVAL_SECONDS`, with a count of the
suppressed ones. ``mammoth_gateway_connections_closed_total{reason}`` counts every close.
"""

from __future__ import annotations

import asyncio
import logging
import resource

import h11
from prometheus_client import Counter, CollectorRegistry
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

from gateway.errors import ErrorInfo, ErrorResponse
from mammoth_core.logging import RateLimitFilter

logger = logging.getLogger(__name__)

FD_HEADROOM = 128
LOG_INTERVAL_SECONDS = 10.0
LINGER_SECONDS = 1.0
#: At the cap, a connection whose request head or body has been incomplete (or which has idled
#: between requests), or whose client has read none of a waiting response, this long may be closed
#: to admit a new one: a head or a small body normally arrives in one round trip.
EVICT_AFTER_S = 0.5
CLOSE_REASONS = ("header_timeout", "body_timeout", "send_timeout", "over_capacity", "evicted")


def _invalid_http_response(too_large: bool, limit: int) -> bytes:
    """The answer to bytes h11 cannot parse as a request (OpenAI envelope): ``431``
    ``request_header_too_large`` when the head outgrew ``limit`` bytes, else ``400``
    ``invalid_http_request``."""
    if too_large:
        line, code = b"431 Request Header Fields Too Large", "request_header_too_large"
        message = f"the request head (request line and headers) is larger than {limit} bytes"
    else:
        line, code = b"400 Bad Request", "invalid_http_request"
        message = "the request is not valid HTTP/1.1"
    body = ErrorResponse(error=ErrorInfo(message=message, type="invalid_request_error",
                                         code=code)).model_dump_json().encode()
    return (b"HTTP/1.1 " + line + b"\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _request_timeout_response(phase: str, seconds: float) -> bytes:
    """The ``408`` (OpenAI envelope, ``code: request_timeout``) for a request ``phase`` (``head``
    or ``body``) not received within ``seconds``."""
    body = ErrorResponse(error=ErrorInfo(
        message=f"the request {phase} did not arrive within {seconds:g} s; send the whole request at once",
        type="invalid_request_error", code="request_timeout")).model_dump_json().encode()
    head = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    return head + body


def _over_capacity_response() -> bytes:
    body = ErrorResponse(error=ErrorInfo(
        message="the gateway has too many open connections; retry shortly",
        type="service_unavailable", code="too_many_connections")).model_dump_json().encode()
    head = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    return head + body


def connection_cap(max_connections: int) -> int:
    """``max_connections``, lowered to the open-file limit minus `FD_HEADROOM` (at least 1)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft - FD_HEADROOM))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header/body deadlines and a connection cap; `guarded_protocol`
    makes the subclass that carries the bounds."""

    header_timeout: float
    body_timeout: float
    send_timeout: float | None
    cap: int
    closed: Counter
    refusal: bytes
    _phase: str | None = None
    _phase_since = 0.0
    _refused = False
    _timer: asyncio.TimerHandle | None = None
    _lost = False
    _send_timer: asyncio.TimerHandle | None = None
    _send_paused_since: float | None = None  # loop time the client stopped reading a waiting response

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.cap and not self._evict_one():
            self.closed.labels("over_capacity").inc()
            logger.warning("refused a connection: %d open (the cap is %d)", len(self.connections),
                           self.cap)
            transport.write(self.refusal)
            transport.close()
            return
        self._track()

    def _stalled_since(self) -> float | None:
        """When this connection began to wait on its client (a request head or body incomplete, or
        a response it does not read), or None while it does not."""
        if self._lost or self.transport is None:
            return None
        if self._send_paused_since is not None:
            return self._send_paused_since
        if self._phase is not None and not self.transport.is_closing():
            return self._phase_since
        return None

    def _evict_one(self) -> bool:
        """Close the open connection stalled longest (at least `EVICT_AFTER_S`, `_stalled_since`);
        False when there is none."""
        now = self.loop.time()
        stalled = [(since, c) for c in self.connections if isinstance(c, GuardedH11Protocol) and c is not self
                   and (since := c._stalled_since()) is not None and now - since >= EVICT_AFTER_S]
        if not stalled:
            return False
        since, victim = min(stalled, key=lambda pair: pair[0])
        if victim._send_paused_since is not None:
            victim._abort_unread(now - since, "evicted")
        else:
            victim._close_in_phase(victim._phase, now - since, "evicted")
        return True

    def pause_writing(self) -> None:
        """The transport's write buffer is over its high-water mark: the client is not reading;
        arm the send deadline (`_abort_unread`)."""
        super().pause_writing()
        if self._send_paused_since is None and not self._lost:
            self._send_paused_since = self.loop.time()
            if self.send_timeout is not None:
                self._send_timer = self.loop.call_later(self.send_timeout, self._send_expired)

    def resume_writing(self) -> None:
        """The client read enough for the buffer to drain below its low-water mark."""
        super().resume_writing()
        self._clear_send_stall()

    def _clear_send_stall(self) -> None:
        """The client reads again (or the connection ends): no send stall, no send deadline."""
        self._send_paused_since = None
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_expired(self) -> None:
        self._send_timer = None
        self._abort_unread(self.send_timeout or 0.0, "send_timeout")

    def _abort_unread(self, seconds: float, reason: str) -> None:
        """Abort this connection, whose client has read none of a waiting response for ``seconds``:
        the buffered bytes are dropped (``close`` would wait for them); counted under ``reason``."""
        self._clear_send_stall()
        self._set_phase(None)
        if self._lost:
            return
        self.closed.labels(reason).inc()
        logger.warning("closed a connection (%s): the client read none of the response for %.1f s", reason, seconds)
        self.transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._refused:  # answered already: what else arrives is read and dropped
            return
        if self.conn.their_state is h11.IDLE and self._head_too_large(data):
            self._refuse(_invalid_http_response(True, self._head_limit))
            return
        super().data_received(data)
        self._track()

    @property
    def _head_limit(self) -> int:
        """Bytes a request head (request line and headers) may have: h11's incomplete-event limit."""
        return self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE

    def _head_too_large(self, data: bytes) -> bool:
        """Whether the request head now arriving (h11's unparsed bytes, at most the limit, then
        ``data``, up to the end of its headers) is over the limit. h11 bounds only a head still
        incomplete when a read ends, so a larger head that arrived whole was accepted: the limit
        depended on how the network split the bytes (a break-it pass: 17-70 KB heads in one send
        answered 200)."""
        limit = self._head_limit
        buffered = self.conn.trailing_data[0]
        if len(buffered) + len(data) <= limit:
            return False
        end = (bytes(buffered) + data[: limit + 4]).find(b"\r\n\r\n")
        return end < 0 or end + 4 > limit  # no end of head within reach, or beyond the limit

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes h11 cannot parse, here in the envelope (`_invalid_http_response`)."""
        limit = self._head_limit
        self._refuse(_invalid_http_response(len(self.conn.trailing_data[0]) > limit, limit))

    def _refuse(self, response: bytes) -> None:
        """Write ``response``, half-close, and close after `LINGER_SECONDS` (or when the client does);
        meanwhile its further bytes are read, so the kernel does not reset the connection over unread
        bytes and drop the response before the client reads it."""
        self._refused = True
        self._set_phase(None)
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._set_phase(None)
        self._clear_send_stall()
        super().connection_lost(exc)

    def _track(self) -> None:
        """Arm the deadline of the phase the client is in (h11's view of its side)."""
        if self.transport is None or self.transport.is_closing():
            return self._set_phase(None)
        state = self.conn.their_state
        if state is h11.IDLE:
            self._set_phase("header")
        elif state is h11.SEND_BODY:
            self._set_phase("body")
        else:
            self._set_phase(None)

    def _set_phase(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._phase = phase
        self._phase_since = self.loop.time()
        if phase is not None:
            seconds = self.header_timeout if phase == "header" else self.body_timeout
            self._timer = self.loop.call_later(seconds, self._expire, phase)

    def _expire(self, phase: str) -> None:
        self._timer = None
        if self._phase != phase or self.transport.is_closing():
            return
        seconds = self.header_timeout if phase == "header" else self.body_timeout
        self._close_in_phase(phase, seconds, f"{phase}_timeout")

    def _close_in_phase(self, phase: str, seconds: float, reason: str) -> None:
        """Close this connection, still in ``phase`` after ``seconds``: the ``408`` first unless a
        response of ours has begun; counted under ``reason``."""
        self._set_phase(None)
        self.closed.labels(reason).inc()
        logger.warning("closed a connection (%s): request %s not received within %.1f s", reason, phase, seconds)
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no response of ours begun yet
            self.transport.write(_request_timeout_response("head" if phase == "header" else "body", seconds))
        self.transport.close()


def guarded_protocol(header_timeout: float, body_timeout: float, max_connections: int,
                     registry: CollectorRegistry | None = None, *,
                     send_timeout: float | None = None) -> type[H11Protocol]:
    """A uvicorn ``http`` protocol class enforcing the module's bounds (`GuardedH11Protocol`).

    Args:
        header_timeout: seconds for a request head (see the module docstring).
        body_timeout: seconds for a request body after its head.
        max_connections: open connections, at most (lowered by `connection_cap`).
        registry: where ``mammoth_gateway_connections_closed_total`` is registered.
        send_timeout: seconds a client may leave a waiting response unread (the gateway setting
            ``send_timeout_seconds``); None: no send deadline, such a connection is only evicted at
            the cap.
    """
    closed = Counter("mammoth_gateway_connections_closed_total",
                     "HTTP connections the gateway closed to bound slow clients, by reason",
                     ["reason"], registry=registry)
    for reason in CLOSE_REASONS:
        closed.labels(reason)
    bounds = {"header_timeout": header_timeout, "body_timeout": body_timeout, "send_timeout": send_timeout,
              "cap": connection_cap(max_connections), "closed": closed,
              "refusal": _over_capacity_response()}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), bounds)


def quiet_logs(interval: float = LOG_INTERVAL_SECONDS) -> None:
    """Rate-limit the loggers a connection flood can repeat (see the module docstring)."""
    limiter = RateLimitFilter(interval)
    for name in ("asyncio", "uvicorn.error", __name__):
        logging.getLogger(name).addFilter(limiter)
