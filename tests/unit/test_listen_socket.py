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


@pytest.mark.parametrize("host", ["::1", "127.0.0.1", ""])
def test_ups_port_check_binds_as_the_gateway_will(host):
    """`mammoth up` checks the gateway's port before the stages spend time loading. The check bound an
    IPv4 socket only, so ``--host ::1`` failed there ("Address family for hostname not supported;
    choose another port with --port") though the gateway listens on IPv6 (`listen_sockets`)."""
    from mammoth_app.local import _check_port_free

    held = listen_sockets(host, 0)
    port = held[0].getsockname()[1]
    _close(held)
    _check_port_free(host, port)  # free: no error


def test_ups_port_check_names_the_host_for_an_address_not_of_this_machine_and_the_holder_of_a_port_in_use():
    from mammoth_app.local import StartupError, _check_port_free

    with pytest.raises(StartupError, match=r"no-such-host\.invalid.*--host"):
        _check_port_free("no-such-host.invalid", 8000)
    held = listen_sockets("127.0.0.1", 0)
    try:
        port = held[0].getsockname()[1]
        with pytest.raises(StartupError, match=rf"127\.0\.0\.1:{port}.*(holds it|another --port)"):
            _check_port_free("127.0.0.1", port)
    finally:
        _close(held)
