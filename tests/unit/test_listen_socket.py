"""`mammoth_core.runtime.listen_sockets`: the gateway binds its own listening sockets before uvicorn
serves them, so that a port in use is one line (`cannot_listen`). They must be the sockets uvicorn
got before, when it bound its own through asyncio's ``loop.create_server``: the same addresses and
families (``''``: IPv4 and IPv6) and the same ``IPV6_V6ONLY`` (so ``::`` does not start taking IPv4
clients); and each failure names what to change."""

from __future__ import annotations

import asyncio
import socket

import pytest

from mammoth_core.runtime import StageStartError, listen_sockets


def _close(sockets):
    for s in sockets:
        s.close()


def test_a_port_in_use_names_the_port_and_the_flag():
    held = listen_sockets("127.0.0.1", 0)
    try:
        port = held[0].getsockname()[1]
        with pytest.raises(StageStartError, match=rf"127\.0\.0\.1:{port} \(--port\).*another --port"):
            listen_sockets("127.0.0.1", port)
    finally:
        _close(held)


def test_an_address_not_of_this_machine_points_at_host():
    with pytest.raises(StageStartError, match=r"no-such-host\.invalid:0 \(--port\).*--host"):
        listen_sockets("no-such-host.invalid", 0)
    with pytest.raises(StageStartError, match=r"192\.0\.2\.1:0 \(--port\).*--host"):  # TEST-NET-1, no one's
        listen_sockets("192.0.2.1", 0)


def _asyncio_sockets(host: str) -> list[tuple[int, int | None]]:
    """(family, IPV6_V6ONLY) of the sockets asyncio's ``create_server`` listens on for ``host``."""
    async def bind():
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, host=host, port=0)
        try:
            return sorted((s.family, _v6only(s)) for s in server.sockets)
        finally:
            server.close()
            await server.wait_closed()

    return asyncio.run(bind())


def _v6only(sock) -> int | None:
    return sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) if sock.family == socket.AF_INET6 else None


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "", "::", "localhost"])
def test_the_sockets_are_the_ones_asyncio_create_server_binds(host):
    try:
        expected = _asyncio_sockets(host)
    except OSError:  # (no IPv6 on this host): then ours fail too, in one line
        with pytest.raises(StageStartError):
            listen_sockets(host, 0)
        return
    ours = listen_sockets(host, 0)
    try:
        assert sorted((s.family, _v6only(s)) for s in ours) == expected
    finally:
        _close(ours)
