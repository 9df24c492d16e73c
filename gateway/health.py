"""The health of one stage backend, as the gateway sees it: reported, probed, or hung.

Two sources, one state (`HealthMonitor`):

- ``grpc.health.v1.Health/Watch`` on the stage's service name tells a change the moment it
  happens (NOT_SERVING when the stage drains). A broken Watch stream is not trusted either way: it
  marks the backend down and probes it at once.
- A liveness probe: ``Health/Check`` with a deadline of ``timeout`` seconds, every ``interval``
  seconds and whenever `probe_now` asks (after a failed call, or when a request's progress is
  overdue, see `gateway.progress_watch`). A probe without an answer within the deadline marks the
  backend down at once and is repeated at once; a second one in a row (SIGSTOP, a wedged event
  loop, a host gone without a reset) makes it **hung**: `hung` is set, which fails the calls in
  flight on it so that they are retried on other replicas. One late answer (a stage's event loop
  held up for a moment) costs no request. A refused connection (a dead process) marks the backend
  down too, without the hang.

While a requested probe is outstanding the backend is `probing`: it is not picked, but it may be
SERVING within ``timeout`` seconds, so requests wait for the answer instead of failing (a backend
marked down after one failed call comes back at once when its health answers SERVING).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
UNKNOWN = health_pb2.HealthCheckResponse.UNKNOWN
#: Probes in a row without an answer within their deadline that make a backend hung.
HUNG_AFTER_TIMEOUTS = 2


def status_name(status: int) -> str:
    """``SERVING``, ``NOT_SERVING``, ``UNKNOWN`` ... for a ``HealthCheckResponse`` status."""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


class HealthMonitor:
    """Watch and probe one backend's ``grpc.health.v1`` status (see the module docstring).

    Args:
        channel: the `grpc.aio.Channel` to the backend.
        service_name: health service name (``mammoth.v1.AR`` / ``mammoth.v1.DiT``).
        interval: seconds between liveness probes (and between Watch reconnects).
        timeout: deadline of one probe, seconds; no answer within it means hung.
        on_change: called with no argument after ``status`` or ``probing`` changed.
        label: names the backend in logs (``"dit 10.0.0.7:50052"``).
        metadata: call metadata of the Watch stream (the stage token,
            `mammoth_core.grpc_common.auth_metadata`): stages serve ``Health/Watch`` to their callers only.

    Attributes:
        status: last known ``HealthCheckResponse`` status (``UNKNOWN`` until the first answer).
        probing: a requested probe has not answered yet.
        hung: an `asyncio.Event` set when `HUNG_AFTER_TIMEOUTS` probes in a row timed out;
            replaced by a fresh one once the backend answers SERVING again.
    """

    def __init__(self, channel: grpc.aio.Channel, service_name: str, interval: float,
                 timeout: float, on_change: Callable[[], None], label: str,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._stub = health_pb2_grpc.HealthStub(channel)
        self._metadata = metadata  # the stage token: a stage serves Health/Watch only to its callers
        self._request = health_pb2.HealthCheckRequest(service=service_name)
        self.interval = interval
        self.timeout = timeout
        self._on_change = on_change
        self.label = label
        self.status = UNKNOWN
        self.probing = False
        self.hung = asyncio.Event()
        self._timeouts = 0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Start the Watch stream and the probe loop (tasks of the running loop)."""
        self._tasks = [asyncio.create_task(self._watch_loop(), name=f"{self.label}-watch"),
                       asyncio.create_task(self._probe_loop(), name=f"{self.label}-probe")]

    async def stop(self) -> None:
        """Cancel both tasks and wait for them."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    def probe_now(self) -> None:
        """Probe at once (``probing`` until the answer, or until ``timeout`` passed)."""
        self._wake.set()
        if not self.probing:
            self.probing = True
            self._on_change()

    def mark_down(self) -> None:
        """Out of rotation after a transport failure of a call, and probed at once: back as soon as
        the stage answers SERVING, down for good while it does not answer."""
        self._set(UNKNOWN)
        self.probe_now()

    # ---------------------------------------------------------------- internals

    def _set(self, status: int) -> None:
        if status == SERVING and self.hung.is_set():
            self.hung = asyncio.Event()
        if status != self.status:
            logger.info("%s is %s", self.label, status_name(status))
            self.status = status
            self._on_change()

    def _timed_out(self) -> None:
        self._timeouts += 1
        self._set(UNKNOWN)
        if self._timeouts < HUNG_AFTER_TIMEOUTS:
            self.probe_now()  # once more at once before calling it hung
            return
        if not self.hung.is_set():
            logger.warning("%s did not answer %d health checks of %.1f s: hung", self.label,
                           self._timeouts, self.timeout)
        self.hung.set()

    async def _probe(self) -> None:
        try:
            response = await self._stub.Check(self._request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._timed_out()
                return
            self._timeouts = 0
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:  # no Check: Watch alone decides
                self._set(UNKNOWN)
        else:
            self._timeouts = 0
            self._set(response.status)

    async def _probe_loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                await self._probe()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep probing whatever happens
                logger.exception("%s: health probe failed", self.label)
                self._set(UNKNOWN)
            if self.probing and not self._wake.is_set():
                self.probing = False
                self._on_change()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()

    async def _watch_loop(self) -> None:
        while True:
            try:
                async for response in self._stub.Watch(self._request, metadata=self._metadata):
                    self._set(response.status)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return  # the probe loop polls Check
                if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    logger.warning("%s: health watch refused (%s: %s); polling Health/Check only (a stage "
                                   "token mismatch also fails its stage calls)", self.label, exc.code().name,
                                   exc.details())
                    return  # the probe loop polls Check, which needs no token
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep watching whatever happens
                logger.exception("%s: health watch failed", self.label)
            # The stream broke or ended: trust neither the old status nor the silence.
            self.mark_down()
            await asyncio.sleep(self.interval)
