"""One convergence step of a pipeline, shared by the pipeline's own handlers and the child observers.

:func:`converge` reads the children, refuses objects it does not own (``NameConflict``), reports a
missing child (``Degraded/ChildMissing``) before recreating it, creates or patches every child,
deletes the optional ones the spec no longer wants, and writes the status. It is level-triggered:
called again with nothing changed, it writes nothing.

:class:`Serializer` runs at most one convergence per pipeline at a time and coalesces the requests
that arrive meanwhile into one more run; :class:`Health` is what the liveness probe reads.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import copy
import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import kopf

from mammoth_operator import builders, kube
from mammoth_operator import status as pipeline_status
from mammoth_operator.spec import ROLE_TOKEN_KEYS, InvalidSpec, PipelineSpec, parse_spec

logger = logging.getLogger(__name__)

#: Bytes of randomness per generated stage token (URL-safe base64: 43 characters).
TOKEN_BYTES = 32


class Health:
    """Time of the last successful reconcile or API observation, and the runs in progress (monotonic s)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.last_success = time.monotonic()
        self._running: dict[int, float] = {}

    def succeeded(self) -> None:
        with self._lock:
            self.last_success = time.monotonic()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        token = id(threading.current_thread())
        with self._lock:
            self._running[token] = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._running.pop(token, None)

    def problem(self, stale_seconds: float) -> str | None:
        """Why the operator looks stuck (None: healthy): no success for ``stale_seconds``, or a run that long."""
        now = time.monotonic()
        with self._lock:
            age = now - self.last_success
            longest = max((now - t for t in self._running.values()), default=0.0)
        if age > stale_seconds:
            return f"no successful reconcile or API call for {age:.0f} s (limit {stale_seconds:.0f} s)"
        if longest > stale_seconds:
            return f"a reconcile has been running for {longest:.0f} s (limit {stale_seconds:.0f} s)"
        return None


class Serializer:
    """At most one convergence per key at a time; requests meanwhile coalesce into one more run."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._pending: set[tuple[str, str]] = set()

    def _lock(self, key: tuple[str, str]) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    @contextlib.contextmanager
    def exclusive(self, key: tuple[str, str]) -> Iterator[None]:
        """Wait for the key's running convergence, then hold it (the pipeline's own handlers)."""
        with self._lock(key):
            with self._guard:
                self._pending.discard(key)
            yield

    def request(self, key: tuple[str, str], run: Callable[[], None]) -> None:
        """Run ``run`` now, or, when a run of ``key`` is in flight, make that one run once more."""
        lock = self._lock(key)
        with self._guard:
            self._pending.add(key)
        while True:
            if not lock.acquire(blocking=False):
                return  # the holder sees the pending flag
            try:
                while self._take(key):
                    run()
            finally:
                lock.release()
            with self._guard:
                if key not in self._pending:
                    return

    def _take(self, key: tuple[str, str]) -> bool:
        with self._guard:
            if key in self._pending:
                self._pending.discard(key)
                return True
            return False


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one convergence did: the apply results and the optional children deleted."""

    results: list[kube.ApplyResult]
    deleted: list[Any]


def _autoscaled(spec: PipelineSpec) -> frozenset[str]:
    return frozenset(stage.component for stage in (spec.ar, spec.dit) if stage.autoscaling.enabled)


def observe(children: kube.Children, namespace: str, name: str, autoscaled: frozenset[str]) -> pipeline_status.Observed:
    """Read the children the status is computed from: three Deployments and the gateway Service."""
    names = builders.child_names(name)
    deployments = {
        component: children.read("apps/v1", "Deployment", namespace, child)
        for component, child in (("ar", names.ar), ("dit", names.dit), ("gateway", names.gateway))
    }
    service = children.read("v1", "Service", namespace, names.gateway)
    return pipeline_status.Observed(deployments=deployments, gateway_service=service, autoscaled=autoscaled)


def status_changes(current: Mapping[str, Any] | None, generation: int, observed_generation: int | None,
                   observed: pipeline_status.Observed, problem: pipeline_status.Problem | None,
                   applied: bool) -> dict[str, Any]:
    """The status keys that changed (empty when nothing changed); ``current`` must be a snapshot.

    Only a successful apply (``applied``) writes ``observedGeneration``.
    """
    desired = pipeline_status.compute_status(generation, observed_generation, observed, problem)
    desired["conditions"] = pipeline_status.merge_conditions((current or {}).get("conditions"), desired["conditions"],
                                                             pipeline_status.now_iso())
    if applied:
        desired["observedGeneration"] = generation
    return pipeline_status.status_changes(current, desired)


def stage_tokens(observed_secret: Mapping[str, Any] | None) -> dict[str, str]:
    """The tokens of the generated Secret as read, or fresh random ones (role -> token) when it is
    absent or unreadable (then it is recreated and the pods roll)."""
    data = (observed_secret or {}).get("data") or {}
    try:
        tokens = {role: base64.b64decode(data[key], validate=True).decode() for role, key in ROLE_TOKEN_KEYS.items()}
    except (KeyError, binascii.Error, UnicodeDecodeError):
        return {role: secrets.token_urlsafe(TOKEN_BYTES) for role in ROLE_TOKEN_KEYS}
    return tokens


def report(children: kube.Children, body: Mapping[str, Any], problem: pipeline_status.Problem | None,
           autoscaled: frozenset[str], applied: bool) -> None:
    """Write the status computed from the children as they are now (nothing when unchanged)."""
    meta = body.get("metadata") or {}
    current = copy.deepcopy(dict(body.get("status") or {}))
    generation = int(meta.get("generation") or 1)
    observed_generation = generation if applied else current.get("observedGeneration")
    observed = observe(children, meta["namespace"], meta["name"], autoscaled)
    children.patch_pipeline_status(meta["namespace"], meta["name"], status_changes(
        current, generation, observed_generation, observed, problem, applied))


def _missing(desired: list[builders.Child], observed: dict[tuple[str, str], Any]) -> list[str]:
    return [f"{c.kind} {c.name}" for c in desired if observed[(c.kind, c.name)] is None]


def converge(children: kube.Children, body: Mapping[str, Any], images: Mapping[str, str]) -> Outcome:
    """Make the children of the pipeline ``body`` equal its spec, then write its status.

    Raises:
        InvalidSpec: the spec breaks a rule (status written: ``Degraded/InvalidSpec``).
        kube.NameConflict: a child's name is taken by an object this pipeline does not control
            (status written: ``Degraded/NameConflict``; nothing is touched).
        kubernetes.client.exceptions.ApiException, urllib3 errors: the API refused or timed out
            (status written, when possible: ``Degraded/ApplyFailed``).
    """
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    generation = int(meta.get("generation") or 1)
    try:
        pipeline = parse_spec(name, namespace, body.get("spec"), images)
    except InvalidSpec as e:
        report(children, body, pipeline_status.Problem("InvalidSpec", str(e)), frozenset(), applied=True)
        raise
    autoscaled = _autoscaled(pipeline)
    tokens = None
    if pipeline.transport.generated_role_tokens:
        secret = children.read("v1", "Secret", namespace, builders.child_names(name).stage_tokens)
        tokens = stage_tokens(secret if secret is None or kube.controlled_by(secret, uid) else None)
    desired = builders.build_children(pipeline, tokens)
    kopf.adopt([child.manifest for child in desired], owner=dict(body))
    observed = {(c.kind, c.name): children.read(c.manifest["apiVersion"], c.kind, namespace, c.name) for c in desired}
    missing = _missing(desired, observed)
    applied_before = (body.get("status") or {}).get("observedGeneration") == generation
    if missing and applied_before:
        message = f"{', '.join(missing)} missing (deleted by hand?); recreating"
        report(children, body, pipeline_status.Problem("ChildMissing", message), autoscaled, applied=False)
        kopf.warn(dict(body), reason="ChildMissing", message=message)
    try:
        results = [kube.apply(children, c, observed[(c.kind, c.name)], uid) for c in desired]
        deleted = kube.delete_unwanted(children, namespace, uid, builders.unwanted_children(pipeline))
    except kube.NameConflict as e:
        report(children, body, pipeline_status.Problem("NameConflict", str(e)), autoscaled, applied=False)
        raise
    except Exception as e:
        with contextlib.suppress(Exception):
            report(children, body, pipeline_status.Problem("ApplyFailed", describe(e)), autoscaled, applied=False)
        raise
    report(children, body, None, autoscaled, applied=True)
    return Outcome(results, deleted)


def describe(error: BaseException) -> str:
    """A short message for an API failure (status code, reason and the start of the server's answer)."""
    status = getattr(error, "status", None)
    if status is not None:
        return f"{status} {getattr(error, 'reason', '')}: {(getattr(error, 'body', None) or '')[:400]}"
    return f"{type(error).__name__}: {str(error)[:400]}"
