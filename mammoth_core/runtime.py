"""Process plumbing shared by the stage and gateway entry points."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import logging
import os
import pathlib
import signal
import socket
import sys
import threading
import time
from typing import Any, NoReturn

from mammoth_core.addresses import format_address


class StageStartError(RuntimeError):
    """A stage could not start because of what it was given (an unusable checkpoint, a bad file, a
    setting the model refuses, a port it cannot listen on): its entry point logs the message as one
    error line and exits 1, no traceback (`mammoth_app.cli`). Raised by a stage's ``serve`` after it
    stopped its gRPC server."""


def cannot_listen(address: str, flag: str, exc: BaseException) -> StageStartError:
    """The `StageStartError` for an ``address`` (``host:port``) a component cannot listen on: names
    the address, the ``flag`` that set its port (``--port``, ``--metrics-port``), why (``exc``'s
    ``strerror``) and what to change. gRPC's bind error carries no errno (its own log line, printed
    before ours, has the cause), so its hint names every usual cause."""
    reason = getattr(exc, "strerror", None)
    code = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
    if code == errno.EADDRINUSE:
        hint = f"stop what holds it or give another {flag} (0: any free port)"
    elif code == errno.EACCES:
        hint = f"ports below 1024 need privileges: give another {flag} (0: any free port)"
    elif code is not None:  # not an address of this machine, a name that does not resolve
        hint = "give --host an address of this machine"
    else:
        reason = reason or "the port is in use or privileged, or the host is not of this machine"
        hint = f"give another {flag} (0: any free port) or --host"
    return StageStartError(f"cannot listen on {address} ({flag}): {reason}; {hint}")


def listen_sockets(host: str, port: int, flag: str = "--port", backlog: int = 2048) -> list[socket.socket]:
    """TCP sockets listening on ``host:port``, bound as asyncio's ``loop.create_server`` binds them
    (what uvicorn used when it bound its own): one per address ``host`` resolves to (``''``: every
    interface, IPv4 and IPv6), ``IPV6_V6ONLY`` on an IPv6 socket, ``SO_REUSEADDR``; ``backlog``
    uvicorn's default. For a server that takes sockets (uvicorn's ``serve(sockets=)``), so that a port
    in use is this process's one-line error, not the server's exit.

    Raises:
        StageStartError: ``host`` does not resolve, or an address cannot be listened on (`cannot_listen`).
    """
    where = format_address(host, port)
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:  # socket.gaierror: a name that does not resolve
        raise cannot_listen(where, flag, exc) from exc
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _name, address in dict.fromkeys(
                (i[0], i[1], i[2], i[3], i[4]) for i in infos):  # unique, in resolver order
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this host lacks (IPv6 disabled): skipped, as asyncio skips it
                continue
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
        if not sockets:
            raise OSError(errno.EAFNOSUPPORT, "no address family of this host can listen on it")
    except OSError as exc:  # in use, privileged, not this machine's
        for sock in sockets:
            sock.close()
        raise cannot_listen(where, flag, exc) from exc
    return sockets


@contextlib.asynccontextmanager
async def starting(server: Any, stage: str):
    """Wrap a stage's start-up after its gRPC ``server`` has started (for the health probes): on any
    failure, stop ``server`` first (else the interpreter's teardown does, after the event loop has
    closed: ``Event loop is closed``); a ``ValueError`` or ``OSError`` (a checkpoint, a file or a
    setting the stage was given) becomes `StageStartError` naming ``stage``; anything else is re-raised
    as it is, traceback and all.

    Raises:
        StageStartError: as above.
    """
    try:
        yield
    except BaseException as exc:
        await server.stop(0)
        if isinstance(exc, (ValueError, OSError)):
            raise StageStartError(f"the {stage} could not start: {exc}") from exc
        raise


def write_ready_file(path: str | None, address: str, **extra: Any) -> None:
    """Atomically write ``{"address": "host:port", "pid": ..., **extra}`` to ``path``.

    ``mammoth up`` passes ``--ready-file`` to each component and waits for this file, which is
    written only once the component is serving (model loaded, port open). No-op when ``path`` is None.
    """
    if not path:
        return
    tmp = pathlib.Path(path + ".tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid(), **extra}))
    os.replace(tmp, path)


def exit_after_drain(code: int = 0) -> NoReturn:
    """End the process at once with ``code``, after flushing logs and stdio.

    For a stage whose server has drained and stopped: what is left is the interpreter's teardown,
    and torch's module finalisation alone takes about 2 s (more on a loaded host), time a rollout
    would wait for nothing. Everything that must outlive the process (spans, logs) is flushed by
    then.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def start_metrics_server(port: int, host: str, routes: dict[str, Any] | None = None) -> int:
    """Serve Prometheus metrics (default registry) on ``host:port``; returns the bound port.

    ``port`` 0 picks a free port; a negative ``port`` disables the server and returns -1. ``host``
    ``''`` is every interface of both families (`metrics_server_family`). ``routes`` maps extra paths
    (e.g. ``/debug/profile``) to WSGI apps served on the same port; every other path answers the metrics.

    Raises:
        StageStartError: ``host:port`` cannot be listened on (`cannot_listen`, naming ``--metrics-port``).
    """
    if port < 0:
        return -1
    try:
        return _start_metrics_server(port, host, routes or {})
    except OSError as exc:  # in use, not this machine's, a name that does not resolve
        raise cannot_listen(format_address(host, port), "--metrics-port", exc) from exc


def metrics_server_family(host: str, port: int) -> tuple[int, bool]:
    """(address family, dual-stack) of the metrics server's socket for ``host``: the family ``host``
    resolves to first (the server class is IPv4 otherwise, and ``--host ::1`` failed with "Address
    family for hostname not supported"), as prometheus_client's own server picks it; for ``''`` (every
    interface) one IPv6 socket that also takes IPv4 (``IPV6_V6ONLY`` off), so a pod of an IPv6
    cluster is scraped on its address, or IPv4 alone where the host has no IPv6.

    Raises:
        OSError: ``host`` does not resolve (`socket.gaierror`).
    """
    if not host and socket.has_ipv6:
        try:
            socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
            return socket.AF_INET6, True
        except OSError:  # IPv6 disabled in this kernel or network namespace
            pass
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return infos[0][0], False


def _start_metrics_server(port: int, host: str, routes: dict[str, Any]) -> int:
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    metrics_app = make_wsgi_app()
    family, dual_stack = metrics_server_family(host, port)

    def app(environ, start_response):
        handler = routes.get(environ.get("PATH_INFO", ""))
        return (handler or metrics_app)(environ, start_response)

    class _Quiet(WSGIRequestHandler):
        def log_message(self, format, *args):  # noqa: A002 - no access log on stderr
            pass

    class _Server(ThreadingWSGIServer):
        address_family = family

        def server_bind(self) -> None:
            if dual_stack:
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            super().server_bind()

    server = make_server(host or ("::" if dual_stack else ""), port, app, _Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return int(server.server_port)


PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Arrange for this process to be killed (SIGKILL) as soon as ``parent_pid`` exits.

    Call it in the child, right at start-up. If the parent is already gone (it died between the
    fork and this call), the process exits at once with status 1.
    """
    armed = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            armed = libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    if os.getppid() != parent_pid:
        os._exit(1)
    if armed:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
