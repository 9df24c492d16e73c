"""Prometheus metrics of the operator (default registry), served by `start_metrics_server`.

- ``mammoth_operator_reconciles_total{handler,result}``: handler runs by result: ``success``,
  ``invalid`` (`kopf.PermanentError`: invalid spec or a child refused as invalid), ``retry``
  (`kopf.TemporaryError`: transient API failure), ``error`` (anything else).
- ``mammoth_operator_reconcile_duration_seconds{handler,result}``: how long each run took.

``handler`` is the kopf handler id: ``reconcile`` (create/update/resume of a pipeline) or
``observe_child`` (an event of an owned child: repair and status).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable

import kopf
from prometheus_client import Counter, Histogram

logger = logging.getLogger(__name__)

RESULTS = ("success", "invalid", "retry", "error")
RECONCILES = Counter("mammoth_operator_reconciles_total", "Operator handler runs by handler and result",
                     ["handler", "result"])
RECONCILE_SECONDS = Histogram(
    "mammoth_operator_reconcile_duration_seconds", "Operator handler run time (seconds)", ["handler", "result"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)


def _result(exc: BaseException | None) -> str:
    if exc is None:
        return "success"
    if isinstance(exc, kopf.PermanentError):
        return "invalid"
    if isinstance(exc, kopf.TemporaryError):
        return "retry"
    return "error"


def timed(handler: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator counting and timing every run of a (synchronous) kopf handler as ``handler``."""
    for result in RESULTS:
        RECONCILES.labels(handler, result)

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            exc: BaseException | None = None
            try:
                return fn(*args, **kwargs)
            except BaseException as e:
                exc = e
                raise
            finally:
                result = _result(exc)
                RECONCILES.labels(handler, result).inc()
                RECONCILE_SECONDS.labels(handler, result).observe(time.perf_counter() - t0)

        return run

    return wrap


def start_metrics_server(port: int, host: str = "0.0.0.0") -> int:
    """Serve ``/metrics`` on ``host:port`` in a daemon thread; returns the bound port, -1 when off.

    ``port`` < 0 disables it; 0 picks a free port. A port that cannot be bound is logged as an
    error and the operator runs on without metrics (reconciling matters more than being scraped).
    """
    if port < 0:
        return -1
    from prometheus_client import start_http_server

    try:
        server, _thread = start_http_server(port, addr=host)
    except OSError as exc:
        logger.error("operator metrics: cannot listen on %s:%d (%s); running without metrics", host, port, exc)
        return -1
    bound = int(server.server_port)
    logger.info("operator metrics on http://%s:%d/metrics", host, bound)
    return bound
