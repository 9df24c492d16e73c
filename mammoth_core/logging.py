"""Logging set-up for every component: text or JSON lines, with the request id when known.

The request id travels in a `contextvars.ContextVar` (``request_id_var``): set it where a request
starts (gateway handler, gRPC servicer) and every log line of that task carries it.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class RateLimitFilter(logging.Filter):
    """Passes each distinct message (logger name + format string) at most once per ``interval``
    seconds; the next one that passes says how many were suppressed meanwhile."""

    def __init__(self, interval: float = 10.0) -> None:
        super().__init__()
        self.interval = interval
        self._seen: dict[tuple[str, str], list[Any]] = {}  # key -> [last passed at, suppressed]

    def reset(self) -> None:
        """Forget every message seen: the next of each passes."""
        self._seen.clear()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self.interval:
            entry[1] += 1
            return False
        suppressed = entry[1] if entry is not None else 0
        if len(self._seen) > 1000:
            self._seen.clear()
        self._seen[key] = [now, 0]
        if suppressed:
            record.msg = f"{record.msg} ({suppressed} similar messages suppressed in the last " \
                         f"{self.interval:.0f} s)"
        return True


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id_var.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, component, request_id, msg (+ exc)."""

    def __init__(self, component: str):
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "component": self.component,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class TextFormatter(logging.Formatter):
    """``time level component [request_id] logger: message``."""

    def __init__(self, component: str):
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        ts = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        line = f"{ts} {record.levelname:<7} {self.component}{f' [{rid}]' if rid else ''} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(component: str, log_format: str = "text", level: str = "info") -> None:
    """Configure the root logger for ``component`` (``ar``, ``dit``, ``gateway``, ``operator``, ``cli``)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component) if log_format == "json" else TextFormatter(component))
    handler.addFilter(_RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
