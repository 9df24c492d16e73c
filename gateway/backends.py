"""Backend discovery, health and least-in-flight selection for one stage (AR or DiT).

Targets (``GatewaySettings.ar`` / ``.dit``), any mix of:

- ``host:port`` (static; local mode), dialled as written;
- ``dns:///name:port`` (or ``dns://authority/name:port``, the authority is ignored): the A/AAAA
  records of ``name`` (a Kubernetes headless Service) are resolved every ``refresh_seconds``; each
  address becomes its own backend ``ip:port``, so requests are balanced over pods by the gateway
  and the DiT address handed to the AR is a pod address the AR can dial.

Health comes from `gateway.health.HealthMonitor`: ``grpc.health.v1.Health/Watch`` on the stage's
service name (``mammoth.v1.AR`` / ``mammoth.v1.DiT``) for changes, plus a ``Check`` with a deadline
every ``refresh_seconds`` (a stage that does not answer in ``probe_timeout_seconds`` is hung). A
backend is eligible only while SERVING. `BackendPool.pick` returns the eligible backend with the
fewest open calls from this gateway (ties rotate). `BackendPool.available` says whether a request
may still be served: some backend SERVING, or one being probed that may answer SERVING within the
probe deadline; when neither, requests fail at once (503 ``no_backend``, ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import grpc

from gateway.health import SERVING, HealthMonitor
from gateway.metrics import GatewayMetrics
from mammoth_core.addresses import Target, format_address, resolve  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Backend:
    """One replica of a stage.

    Attributes:
        address: ``host:port`` the gateway dials (and hands to the AR as ``dit_address``).
        channel: the `grpc.aio.Channel` to it.
        stub: the generated stub (`mammoth_pb2_grpc.ARStub` / ``DiTStub``) on ``channel``.
        health: its `HealthMonitor` (status, probing, hung).
        in_flight: open ``Generate`` calls from this gateway.
    """

    address: str
    channel: grpc.aio.Channel
    stub: Any
    health: HealthMonitor = field(repr=False)
    in_flight: int = 0
    retired: bool = False

    @property
    def status(self) -> int:
        """Last known ``grpc.health.v1`` status (``SERVING`` = 1)."""
        return self.health.status

    @property
    def serving(self) -> bool:
        return self.status == SERVING and not self.retired


class BackendPool:
    """The backends of one stage, kept in sync with the targets and their health.

    Args:
        stage: ``"ar"`` or ``"dit"`` (metric label).
        targets: target strings (see module docstring).
        service_name: health service name checked (``mammoth.v1.AR`` / ``mammoth.v1.DiT``).
        stub_factory: builds the stage stub from a channel.
        metrics: gateway metrics (``backends_serving``, ``backend_in_flight``).
        refresh_seconds: DNS refresh and health probe period.
        channel_options: gRPC channel options (message size limits).
        channel_credentials: TLS credentials to dial the backends with (None: plaintext).
        probe_timeout_seconds: deadline of one health probe (``health_timeout_seconds``), seconds.
        call_metadata: metadata of the health Watch streams (the gateway's stage token).
    """

    def __init__(
        self,
        stage: str,
        targets: list[str],
        service_name: str,
        stub_factory: Callable[[grpc.aio.Channel], Any],
        metrics: GatewayMetrics,
        refresh_seconds: float = 2.0,
        channel_options: list[tuple[str, Any]] | None = None,
        channel_credentials: grpc.ChannelCredentials | None = None,
        *,
        probe_timeout_seconds: float,
        call_metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.stage = stage
        self.targets = [Target.parse(t) for t in targets]
        self.service_name = service_name
        self._stub_factory = stub_factory
        self._metrics = metrics
        self.refresh_seconds = refresh_seconds
        self.probe_timeout_seconds = probe_timeout_seconds
        self._call_metadata = call_metadata
        self._options = channel_options or []
        self._credentials = channel_credentials
        self.backends: dict[str, Backend] = {}
        self._rr = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._changed = asyncio.Event()

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Create backends for static targets and start DNS refresh and health watches."""
        await self._refresh_dns(initial=True)
        if any(t.dns for t in self.targets):
            self._tasks.append(asyncio.create_task(self._dns_loop(), name=f"{self.stage}-dns"))

    async def close(self) -> None:
        """Stop every background task and close every channel."""
        for t in self._tasks:
            t.cancel()
        for b in list(self.backends.values()):
            await self._remove(b)
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_seconds)
            await self._refresh_dns()

    async def _refresh_dns(self, initial: bool = False) -> None:
        wanted: set[str] = set()
        for target in self.targets:
            addresses = await resolve(target)
            if addresses is None:  # resolution failed: keep what we have for this target
                wanted |= {a for a in self.backends if target.dns}
            else:
                wanted |= addresses
        for address in sorted(wanted - set(self.backends)):
            self._add(address)
        for address in set(self.backends) - wanted:
            logger.info("%s: backend %s left DNS", self.stage, address)
            await self._remove(self.backends[address])

    def _add(self, address: str) -> None:
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(address, options=self._options)
        else:
            channel = grpc.aio.secure_channel(address, self._credentials, options=self._options)
        health = HealthMonitor(channel, self.service_name, self.refresh_seconds,
                               self.probe_timeout_seconds, self._health_changed,
                               f"{self.stage} backend {address}", self._call_metadata)
        backend = Backend(address=address, channel=channel, stub=self._stub_factory(channel),
                          health=health)
        self.backends[address] = backend
        health.start()
        logger.info("%s: backend %s added", self.stage, address)

    async def _remove(self, backend: Backend) -> None:
        backend.retired = True
        self.backends.pop(backend.address, None)
        await backend.health.stop()
        self._update_gauges()
        if backend.in_flight == 0:
            await backend.channel.close()
            with contextlib.suppress(KeyError):
                self._metrics.backend_in_flight.remove(self.stage, backend.address)

    # ---------------------------------------------------------------- health

    def _health_changed(self) -> None:
        self._update_gauges()
        self._changed.set()
        self._changed = asyncio.Event()

    def _update_gauges(self) -> None:
        self._metrics.backends_serving.labels(self.stage).set(len(self.serving()))

    def mark_failed(self, backend: Backend) -> None:
        """Take ``backend`` out of rotation after a transport failure of a call (a broken stream is
        evidence enough) and probe it at once: it is back as soon as it answers SERVING."""
        if not backend.retired:
            backend.health.mark_down()

    # ---------------------------------------------------------------- selection

    def serving(self) -> list[Backend]:
        """Backends currently SERVING."""
        return [b for b in self.backends.values() if b.serving]

    def available(self) -> bool:
        """Whether a request may still be served: a backend is SERVING, or one is being probed
        (it may answer SERVING within the probe deadline)."""
        return any(b.serving or b.health.probing for b in self.backends.values() if not b.retired)

    def pick(self, exclude: set[str] | frozenset[str] = frozenset()) -> Backend | None:
        """The SERVING backend not in ``exclude`` (addresses) with the fewest open calls, or None."""
        candidates = [b for b in self.serving() if b.address not in exclude]
        if not candidates:
            return None
        least = min(b.in_flight for b in candidates)
        tied = [b for b in candidates if b.in_flight == least]
        return tied[next(self._rr) % len(tied)]

    async def wait_changed(self, timeout: float) -> None:
        """Return when any backend's health changes, or after ``timeout`` seconds."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    @contextlib.contextmanager
    def lease(self, backend: Backend) -> Iterator[Backend]:
        """Count one open call on ``backend`` for the duration of the block."""
        backend.in_flight += 1
        gauge = self._metrics.backend_in_flight.labels(self.stage, backend.address)
        gauge.set(backend.in_flight)
        try:
            yield backend
        finally:
            backend.in_flight -= 1
            gauge.set(backend.in_flight)
            if backend.retired and backend.in_flight == 0:
                asyncio.get_running_loop().create_task(backend.channel.close())
