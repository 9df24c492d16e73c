"""`mammoth_core.runtime.listen_socket`: the gateway binds its own listening socket before uvicorn
serves it, so that a port in use is one line (`cannot_listen`). It must bind as uvicorn did: ``::``
still takes IPv4 clients where the system is dual-stack (Python's ``socket.create_server`` would set
``IPV6_V6ONLY`` and cut them off), and each failure names what to change."""

from __future__ import annotations

import socket

import pytest

from mammoth_core.runtime import StageStartError, listen_socket


def test_a_port_in_use_names_the_port_and_the_flag():
    with listen_socket("127.0.0.1", 0) as held:
        port = held.getsockname()[1]
        with pytest.raises(StageStartError, match=rf"127\.0\.0\.1:{port} \(--port\).*another --port"):
            listen_socket("127.0.0.1", port)


def test_an_address_not_of_this_machine_points_at_host():
    with pytest.raises(StageStartError, match=r"no-such-host\.invalid:0 \(--port\).*--host"):
        listen_socket("no-such-host.invalid", 0)


def test_the_ipv6_wildcard_keeps_the_systems_dual_stack_default():
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::", 0))
            default = probe.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
    except OSError:  # no IPv6 on this host: then the wildcard is refused in one line, pointing at --host
        with pytest.raises(StageStartError, match="--host"):
            listen_socket("::", 0)
        return
    with listen_socket("::", 0) as held:
        assert held.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == default
        if default == 0:  # dual-stack: an IPv4 client reaches it, as it reached uvicorn's own socket
            socket.create_connection(("127.0.0.1", held.getsockname()[1]), timeout=5).close()
