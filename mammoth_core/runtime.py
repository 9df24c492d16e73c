"""Process plumbing shared by the stage and gateway entry points."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any


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


def start_metrics_server(port: int, host: str, routes: dict[str, Any] | None = None) -> int:
    """Serve Prometheus metrics (default registry) on ``host:port``; returns the bound port.

    ``port`` 0 picks a free port; a negative ``port`` disables the server and returns -1.
    ``routes`` maps extra paths (e.g. ``/debug/profile``) to WSGI apps served on the same port;
    every other path answers the metrics.
    """
    if port < 0:
        return -1
    if not routes:
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=host)
        return int(server.server_port)
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    metrics_app = make_wsgi_app()

    def app(environ, start_response):
        handler = routes.get(environ.get("PATH_INFO", ""))
        return (handler or metrics_app)(environ, start_response)

    class _Quiet(WSGIRequestHandler):
        def log_message(self, format, *args):  # noqa: A002 - no access log on stderr
            pass

    server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return int(server.server_port)
