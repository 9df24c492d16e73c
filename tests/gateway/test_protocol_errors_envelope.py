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


def _guarded(deadline_s: float, max_connections: int, **bounds) -> GatewayThread:
    """The gateway app under uvicorn with the guarded protocol (both read deadlines ``deadline_s``;
    ``bounds``: `guarded_protocol`'s keyword arguments), started; the protocol class is ``gw.protocol``."""
    gw = GatewayThread(small_settings())
    gw.protocol = guarded_protocol(deadline_s, deadline_s, max_connections, **bounds)
    config = uvicorn.Config(gw.app, host="127.0.0.1", port=0, lifespan="on", log_config=None,
                            access_log=False, timeout_graceful_shutdown=2, http=gw.protocol)
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


def _status_lines(sockets: list[socket.socket]) -> list[bytes]:
    """The first 12 bytes each socket received within 0.5 s (``b""``: none), each then closed."""
    answers = []
    for s in sockets:
        s.settimeout(0.5)
        try:
            answers.append(s.recv(200)[:12])
        except (TimeoutError, socket.timeout):
            answers.append(b"")
        s.close()
    return answers


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
        answers = _status_lines(stalled)
        assert answers.count(b"HTTP/1.1 408") == 1, answers  # the oldest stalled head, answered and closed
    finally:
        gw.stop()


def _stalled_at_the_cap(port: int, count: int, first: bytes, *, unread: bool = False) -> list[socket.socket]:
    """``count`` connections that each send ``first`` and then stall; ``unread``: their receive
    buffers are small and they never read (``first`` pipelines requests whose answers pile up)."""
    stalled = []
    for _ in range(count):
        s = socket.socket()
        if unread:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(10)
        s.connect(("127.0.0.1", port))
        s.sendall(first)
        stalled.append(s)
    return stalled


def _closed_by_the_gateway(s: socket.socket, within_s: float) -> bool:
    """Whether the gateway closed (or reset) ``s`` within ``within_s`` seconds; reads and drops
    what it sent."""
    s.settimeout(0.2)
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            if not s.recv(1 << 20):
                return True
        except (TimeoutError, socket.timeout):
            continue
        except OSError:  # reset: the gateway aborted it
            return True
    return False


def _healthz(port: int) -> bytes:
    """The answer to ``GET /healthz`` on a new connection (a reset: the gateway refused it unread)."""
    try:
        return _answer(port, b"GET /healthz HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")[0]
    except ConnectionResetError:
        return b"reset: refused at the connection cap"


def _closes(protocol, reason: str) -> float:
    return protocol.closed.labels(reason)._value.get()


PIPELINED = b"GET /openapi.json HTTP/1.1\r\nHost: gw\r\n\r\n" * 400  # ~10 MB of answers, never read


def test_at_the_connection_cap_a_new_request_evicts_a_stalled_body():
    """At the cap, connections that sent a head announcing a body and then stalled are evicted like
    stalled heads (408, closed): a break-it pass held the cap of a real gateway with 1,030 such
    connections and ``/healthz`` answered 503 for their whole 30 s body deadline."""
    from gateway.slow_clients import EVICT_AFTER_S

    gw = _guarded(30.0, 8)
    try:
        port = int(gw.url.rsplit(":", 1)[1])
        stalled = _stalled_at_the_cap(port, 8, HEAD + b"Content-Length: 100\r\n\r\n{")
        time.sleep(EVICT_AFTER_S + 0.3)
        data = _healthz(port)
        assert data.startswith(b"HTTP/1.1 200"), data[:300]
        answers = _status_lines(stalled)
        assert answers.count(b"HTTP/1.1 408") == 1, answers
        assert _closes(gw.protocol, "evicted") == 1
    finally:
        gw.stop()


def test_at_the_connection_cap_a_new_request_evicts_a_client_that_reads_nothing():
    """At the cap, connections whose clients pipelined requests and read none of the answers are
    evicted (aborted): the break-it pass locked a real gateway's ``/healthz`` out with 17 such
    clients at a cap of 16, for as long as they stayed (the read deadlines end with the request)."""
    from gateway.slow_clients import EVICT_AFTER_S

    gw = _guarded(30.0, 8)
    try:
        port = int(gw.url.rsplit(":", 1)[1])
        stalled = _stalled_at_the_cap(port, 8, PIPELINED, unread=True)
        time.sleep(EVICT_AFTER_S + 1.5)  # the answers fill the socket buffers: the writes pause
        data = _healthz(port)
        # on a loaded CI host the gateway may take longer to write 8 x 10 MB of answers until every
        # write pauses (CI of 2026-12-07: refused once at 2 s); a refused probe (503 or a reset)
        # changes nothing, and the fault this guards held /healthz refused for the clients' whole 30 s
        deadline = time.monotonic() + 15
        while not data.startswith(b"HTTP/1.1 200") and time.monotonic() < deadline:
            time.sleep(0.5)
            data = _healthz(port)
        assert data.startswith(b"HTTP/1.1 200"), data[:300]
        assert _closes(gw.protocol, "evicted") == 1
        for s in stalled:
            s.close()
    finally:
        gw.stop()


def test_a_client_that_stops_reading_is_aborted_after_the_send_deadline():
    """``send_timeout``: a client that reads none of a waiting response for that long loses its
    connection (aborted: a close would wait for the unread bytes forever); before, the break-it
    pass saw such a connection held 40 s and more, 2.8 MB waiting in the kernel's buffers. A client
    that keeps reading is not touched."""
    gw = _guarded(30.0, 100, send_timeout=1.0)
    try:
        port = int(gw.url.rsplit(":", 1)[1])
        [unread] = _stalled_at_the_cap(port, 1, PIPELINED, unread=True)
        time.sleep(3.0)  # the writes pause within a moment; the deadline is 1 s after that
        assert _closes(gw.protocol, "send_timeout") == 1
        assert _closed_by_the_gateway(unread, within_s=2.0)
        unread.close()
        reader = socket.create_connection(("127.0.0.1", port), timeout=10)
        reader.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: gw\r\n\r\n" * 50)
        received, t0 = 0, time.monotonic()
        while received < 50 * 1000 and time.monotonic() - t0 < 10:
            received += len(reader.recv(1 << 16))
            time.sleep(0.01)
        reader.close()
        assert _closes(gw.protocol, "send_timeout") == 1  # the reading client was not cut off
    finally:
        gw.stop()
