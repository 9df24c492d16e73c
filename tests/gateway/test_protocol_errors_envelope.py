"""HTTP-level refusals (a request too slow, not HTTP, a head too large) in the OpenAI error envelope.

The real gateway app runs under uvicorn with the guarded protocol `mammoth gateway` installs
(`gateway.slow_clients.guarded_protocol`), with 0.5 s deadlines; raw sockets send the requests.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import uvicorn

from gateway.slow_clients import guarded_protocol
from tests.gateway.conftest import GatewayThread, _no_signals, small_settings

DEADLINE_S = 0.5
HEAD = b"POST /v1/images/generations HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"


def _guarded(deadline_s: float, max_connections: int) -> GatewayThread:
    """The gateway app under uvicorn with the guarded protocol (both deadlines ``deadline_s``), started."""
    gw = GatewayThread(small_settings())
    config = uvicorn.Config(gw.app, host="127.0.0.1", port=0, lifespan="on", log_config=None,
                            access_log=False, timeout_graceful_shutdown=2,
                            http=guarded_protocol(deadline_s, deadline_s, max_connections))
    gw.server = uvicorn.Server(config)
    gw.server.capture_signals = _no_signals  # type: ignore[method-assign]
    gw.start()
    return gw


@pytest.fixture
def guarded_gateway():
    gw = _guarded(DEADLINE_S, 100)
    yield gw
    gw.stop()


def _envelope(data: bytes, status: bytes) -> dict:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 " + status), data[:200]
    assert b"content-type: application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _answer(port: int, first: bytes) -> tuple[bytes, float]:
    """Send ``first``, then nothing; everything the gateway sends until it closes, and when."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    t0 = time.monotonic()
    s.sendall(first)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    return data, time.monotonic() - t0


@pytest.mark.parametrize("first,part", [
    (HEAD, "head"),
    (HEAD + b"Content-Length: 100\r\n\r\n{\"prompt\"", "body"),
])
def test_a_request_not_received_in_time_is_408_with_the_envelope(guarded_gateway, first, part):
    port = int(guarded_gateway.url.rsplit(":", 1)[1])
    data, seconds = _answer(port, first)
    assert seconds < DEADLINE_S + 5, seconds
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"content-type: application/json" in head.lower(), head
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "request_timeout" and err["type"] == "invalid_request_error", err
    assert f"request {part}" in err["message"] and "0.5 s" in err["message"], err


@pytest.mark.parametrize("request_bytes,status,code", [
    (b"GARBAGE\r\n\r\n", b"400", "invalid_http_request"),
    (HEAD + b"X-Junk: " + b"x" * 200_000 + b"\r\n\r\n", b"431", "request_header_too_large"),
    # a head over 16 KiB that arrives whole (break-it pass: one send of 17-70 KB, or 1,000 small
    # headers, got 200: h11's limit counts only an incomplete head, so it depended on segmentation)
    (HEAD + b"X-Junk: " + b"x" * 17_000 + b"\r\n\r\n", b"431", "request_header_too_large"),
    (HEAD + b"X-Junk: " + b"x" * 60_000 + b"\r\n\r\n", b"431", "request_header_too_large"),
    (HEAD + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 40) for i in range(1000)) + b"\r\n", b"431",
     "request_header_too_large"),
])
def test_a_request_that_is_not_valid_http_gets_the_envelope(guarded_gateway, request_bytes, status, code):
    port = int(guarded_gateway.url.rsplit(":", 1)[1])
    data, _ = _answer(port, request_bytes)
    err = _envelope(data, status)
    assert err["code"] == code and err["type"] == "invalid_request_error", err


def test_content_length_with_chunked_is_refused_and_the_connection_closed(guarded_gateway):
    """RFC 9112 §6.3: a request with both Content-Length and Transfer-Encoding may be smuggling;
    the server must close the connection after answering it. Before, the gateway kept the
    connection, and its body-size limit trusted the Content-Length while h11 framed the body by
    its chunks (a chunked body of any size reached the app behind a small Content-Length)."""
    port = int(guarded_gateway.url.rsplit(":", 1)[1])
    body = b'{"prompt": "p", "size": "64x64"}'
    framed = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    data, seconds = _answer(port, HEAD + b"Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n" + framed)
    assert seconds < DEADLINE_S, seconds  # closed after the answer, not by the next head's deadline
    err = _envelope(data, b"400")
    assert err["code"] == "invalid_http_request" and "Transfer-Encoding" in err["message"], err


def test_at_the_connection_cap_a_new_request_evicts_a_stalled_head():
    """At the cap, a new connection closes the longest-stalled connection still in its head phase
    (older than `EVICT_AFTER_S`) instead of being refused: a slowloris filling the cap no longer
    refuses the kubelet's ``/healthz`` probe on the same port (break-it pass: held about 60 s, that
    would have restarted the gateway and killed its in-flight work). Header deadline 30 s here, so
    only the eviction can free a place."""
    from gateway.slow_clients import EVICT_AFTER_S

    gw = _guarded(30.0, 8)
    try:
        port = int(gw.url.rsplit(":", 1)[1])
        stalled = []
        for _ in range(8):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(HEAD[:20])
            stalled.append(s)
        time.sleep(EVICT_AFTER_S + 0.3)
        data, _ = _answer(port, b"GET /healthz HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
        assert data.startswith(b"HTTP/1.1 200"), data[:300]
        answers = []
        for s in stalled:
            s.settimeout(0.5)
            try:
                answers.append(s.recv(200)[:12])
            except (TimeoutError, socket.timeout):
                answers.append(b"")
            s.close()
        assert answers.count(b"HTTP/1.1 408") == 1, answers  # the oldest stalled head, answered and closed
    finally:
        gw.stop()
