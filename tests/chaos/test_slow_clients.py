"""Slow clients against the real gateway process (issue 15.5): slowloris heads and bodies.

The gateway (``mammoth gateway``, fake stages behind it) runs with a 2 s header and body timeout
(``MAMMOTH_HEADER_TIMEOUT_SECONDS``, ``MAMMOTH_BODY_TIMEOUT_SECONDS``). 200 connections send their
request head a byte at a time (never finishing it) or announce a body they never send; meanwhile a
normal request must succeed within 2 s, every slow connection must be closed by the gateway within
the timeout (plus scheduling slack), and the gateway's log must stay small. A second gateway runs
with a low open-file limit and gets more connections than it may hold: the excess is answered 503
at once, nothing floods the log, and it serves again once the slow ones are gone.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

TIMEOUT_S = 2.0
SLACK_S = 1.5
SLOW = 200
LOG_LIMIT_BYTES = 20_000
HEAD = b"POST /v1/images/generations HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"


class SlowClients:
    """``n`` connections to ``address``, each fed by one thread: ``mode`` ``head`` drips header
    bytes forever, ``body`` sends a complete head announcing 1,000 body bytes and then drips the
    body. Records when the server closed each one (monotonic seconds, None while open)."""

    def __init__(self, address: str, n: int, mode: str) -> None:
        host, port = address.rsplit(":", 1)
        self.opened: list[float] = []
        self.closed: list[float | None] = []
        self.refused = 0  # answered at once with a response instead (over the connection cap)
        self.socks: list[socket.socket] = []
        for _ in range(n):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.setblocking(False)
            self.socks.append(s)
            self.opened.append(time.monotonic())
            self.closed.append(None)
        self.mode = mode
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _feed(self, i: int, step: int) -> None:
        s = self.socks[i]
        if self.mode == "body" and step == 0:
            data = HEAD + b"Content-Length: 1000\r\n\r\n{"
        elif self.mode == "head":
            data = HEAD[:10] if step == 0 else b"X"
        else:
            data = b" "
        try:
            s.send(data)
        except BlockingIOError:
            pass
        except OSError:
            self.closed[i] = self.closed[i] or time.monotonic()

    def _poll(self, i: int) -> None:
        try:
            data = self.socks[i].recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data.startswith(b"HTTP/1.1 503"):
            self.refused += 1
        self.closed[i] = time.monotonic()

    def _run(self) -> None:
        step = 0
        while not self._stop and any(c is None for c in self.closed):
            for i in range(len(self.socks)):
                if self.closed[i] is None:
                    self._poll(i)
                if self.closed[i] is None:
                    self._feed(i, step)
            step += 1
            time.sleep(0.25)

    def wait_all_closed(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(c is None for c in self.closed):
            time.sleep(0.05)
        return all(c is not None for c in self.closed)

    def lifetimes(self) -> list[float]:
        return [c - o for o, c in zip(self.opened, self.closed) if c is not None]

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        for s in self.socks:
            s.close()


def gateway_env() -> dict[str, str]:
    return {"MAMMOTH_HEADER_TIMEOUT_SECONDS": str(TIMEOUT_S), "MAMMOTH_BODY_TIMEOUT_SECONDS": str(TIMEOUT_S)}


def normal_request(url: str) -> tuple[int, float]:
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/images/generations", timeout=10,
                   json={"prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 2, "seed": 1})
    return r.status_code, time.monotonic() - t0


@pytest.mark.parametrize("mode", ["head", "body"])
def test_slowloris_is_timed_out_and_normal_requests_still_succeed(cluster, mode):
    cluster.env.update(gateway_env())
    ar, dit = cluster.fake_stage("ar"), cluster.fake_stage("dit", "--slots", "4", "--step-delay", "0")
    gw = cluster.gateway([ar], [dit])
    url = f"http://{gw.address}"
    assert normal_request(url)[0] == 200  # warm
    log_before = gw.log.stat().st_size
    slow = SlowClients(gw.address, SLOW, mode)
    try:
        time.sleep(0.5)
        status, seconds = normal_request(url)
        assert status == 200 and seconds < 2.0, (status, seconds)
        assert slow.wait_all_closed(TIMEOUT_S + SLACK_S + 2.0), \
            f"{sum(c is None for c in slow.closed)} of {SLOW} slow connections still open"
        assert max(slow.lifetimes()) < TIMEOUT_S + SLACK_S, max(slow.lifetimes())
        assert slow.refused == 0
    finally:
        slow.close()
    assert normal_request(url)[0] == 200
    grown = gw.log.stat().st_size - log_before
    assert grown < LOG_LIMIT_BYTES, gw.log.read_text()[-2000:]


def test_more_connections_than_files_are_refused_quietly(cluster):
    cluster.env.update(gateway_env())
    ar, dit = cluster.fake_stage("ar"), cluster.fake_stage("dit", "--slots", "4", "--step-delay", "0")
    gw = cluster.gateway([ar], [dit], nofile=256)
    url = f"http://{gw.address}"
    assert normal_request(url)[0] == 200
    log_before = gw.log.stat().st_size
    slow = SlowClients(gw.address, 300, "head")
    try:
        assert slow.wait_all_closed(TIMEOUT_S + SLACK_S + 2.0)
        assert slow.refused > 0, "no connection was refused at the cap"
        status, _ = normal_request(url)
        assert status == 200
    finally:
        slow.close()
    grown = gw.log.stat().st_size - log_before
    assert grown < LOG_LIMIT_BYTES, gw.log.read_text()[-2000:]
