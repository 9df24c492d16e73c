"""Profiling on demand: a PyTorch profiler trace of a stage's model work for the next N requests.

Arm it at start-up (setting ``profile_requests``) or at run time on the stage's metrics port, with
the gateway's (or the shared) stage token -- the endpoint is behind the same auth as the stage's RPCs
(`guarded`; 401 without a token, 403 with the AR's)::

    curl -X POST -H "Authorization: Bearer $(cat gateway.token)" \
        'http://<stage>:9092/debug/profile?requests=3'                # arm for the next 3 requests
    curl -H "Authorization: Bearer $(cat gateway.token)" 'http://<stage>:9092/debug/profile'  # state

Each profiled request writes one Chrome trace (open in ``chrome://tracing`` or Perfetto) named
``<profile_dir>/<stage>-<request_id>-<unix ms>.pt.trace.json``. One request is profiled at a time
(the PyTorch profiler is process-wide); a request that starts while another is being profiled runs
unprofiled and leaves the count untouched.

When nothing is armed, `StageProfiler.capture` is one integer comparison and returns a shared
null context: no profiler object exists, the model code runs exactly as without this module, so
outputs are bit-identical (tested in ``tests/integration/test_metrics.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import re
import threading
import time
from typing import Any, Iterator
from urllib.parse import parse_qs

logger = logging.getLogger(__name__)

PROFILE_PATH = "/debug/profile"
MAX_REQUESTS = 100
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
_NULL = contextlib.nullcontext()


class StageProfiler:
    """Counts down armed requests and wraps their model work in `torch.profiler.profile`.

    Args:
        directory: where traces go (created on first use).
        stage: ``ar`` or ``dit``: the trace file prefix.
        requests: requests to profile from start-up (0: off).
    """

    def __init__(self, directory: str, stage: str, requests: int = 0) -> None:
        self.directory = pathlib.Path(directory)
        self.stage = stage
        self.remaining = max(0, int(requests))
        self.written: list[str] = []
        self._lock = threading.Lock()
        self._busy = False

    def arm(self, requests: int) -> dict[str, Any]:
        """Profile the next ``requests`` requests (0 disarms). Returns `state`.

        Raises:
            ValueError: ``requests`` outside ``[0, MAX_REQUESTS]``.
        """
        if not 0 <= requests <= MAX_REQUESTS:
            raise ValueError(f"requests must be in [0, {MAX_REQUESTS}], got {requests}")
        with self._lock:
            self.remaining = requests
        logger.info("profiler armed for the next %d request(s); traces go to %s", requests, self.directory)
        return self.state()

    def state(self) -> dict[str, Any]:
        """``{"stage", "armed", "directory", "traces"}`` (traces: the files written so far)."""
        return {"stage": self.stage, "armed": self.remaining, "directory": str(self.directory),
                "traces": list(self.written)}

    def capture(self, request_id: str) -> contextlib.AbstractContextManager:
        """The context to run one request's model work in: a profiler when armed, else a no-op."""
        if self.remaining <= 0:  # the only cost when off
            return _NULL
        with self._lock:
            if self.remaining <= 0 or self._busy:
                return _NULL
            self.remaining -= 1
            self._busy = True
        return self._profile(request_id)

    @contextlib.contextmanager
    def _profile(self, request_id: str) -> Iterator[None]:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        try:
            with profile(activities=activities, record_shapes=True) as prof:
                yield
            self.directory.mkdir(parents=True, exist_ok=True)
            name = f"{self.stage}-{_SAFE.sub('_', request_id)[:100]}-{int(time.time() * 1000)}.pt.trace.json"
            path = self.directory / name
            prof.export_chrome_trace(str(path))
            self.written.append(str(path))
            logger.info("profiler trace of request %s written to %s", request_id, path)
        finally:
            with self._lock:
                self._busy = False

    def wsgi(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        """WSGI handler of ``GET|POST /debug/profile[?requests=N]`` (POST arms, GET reads state)."""
        method = environ.get("REQUEST_METHOD", "GET")
        status, body = "200 OK", None
        if method == "POST":
            raw = (parse_qs(environ.get("QUERY_STRING", "")).get("requests") or ["1"])[0]
            try:
                body = self.arm(int(raw))
            except ValueError as exc:
                status, body = "400 Bad Request", {"error": f"invalid requests={raw!r}: {exc}"}
        elif method == "GET":
            body = self.state()
        else:
            status, body = "405 Method Not Allowed", {"error": "use GET or POST"}
        data = json.dumps(body).encode()
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]


def guarded(app: Any, auth: Any) -> Any:
    """``app`` (WSGI) behind ``auth`` (`mammoth_core.grpc_common.StageAuth`) for the method
    `grpc_common.PROFILE_METHOD`: the request's ``Authorization: Bearer <token>`` must be allowed,
    else 401 (no, unknown or unconfigured token) or 403 (a token of another role), JSON body."""
    import grpc

    from mammoth_core.grpc_common import PROFILE_METHOD

    def checked(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        refusal = auth.check_header(PROFILE_METHOD, environ.get("HTTP_AUTHORIZATION"))
        if refusal is None:
            return app(environ, start_response)
        code, message = refusal
        status = "403 Forbidden" if code == grpc.StatusCode.PERMISSION_DENIED else "401 Unauthorized"
        data = json.dumps({"error": message}).encode()
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                                ("WWW-Authenticate", "Bearer")])
        return [data]

    return checked
