"""kopf handlers of the ``MammothPipeline`` operator.

One concern per handler:

* :func:`configure` (startup): kopf settings (annotation prefixes, progress kept in annotations,
  watch and request timeouts, events) and the API client with a timeout on every call.
* one index per child kind (``@kopf.index``, :mod:`~mammoth_operator.observed`): Secrets,
  ConfigMaps, Services, Deployments, PDBs, HPAs, NetworkPolicies with our ``managed-by`` label,
  keyed by namespace and name; every convergence reads the children from them, not from list calls.
* :func:`reconcile` (create, update, resume of a pipeline): one :func:`~mammoth_operator.reconcile.converge`
  of every child with kopf's retries: an invalid spec fails permanently (until the spec changes); a
  refused or failed apply (403, 409, 422, 5xx, timeouts) and a name conflict are retried with backoff.
* :func:`observe_child`, one handler per child kind (``observe_<plural>``): a child changed or went
  away, so converge that child of its pipeline again (a Secret: every child) and write the status,
  so a child deleted or edited by hand is repaired within seconds and the status follows the
  Deployments' status. Every convergence reads a child the operator wrote itself from that write
  while the child's watch still delivers older states (:class:`~mammoth_operator.observed.OwnWrites`:
  a late event is no drift). No kopf timer and no deletion handler: kopf puts no finalizer on
  pipelines, so deleting a pipeline (or its namespace, or the CRD) never waits for the operator.
* :func:`probe_progress` (liveness): fails when no reconcile or API call succeeded for
  ``probe_stale_seconds`` or one run takes that long, so the kubelet restarts a stuck operator.

Handlers are registered on an explicit registry by :func:`register`, so the process entry point (and
the tests) choose the settings; nothing registers on import.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from mammoth_operator import builders, kube, metrics, observed
from mammoth_operator import reconcile as convergence
from mammoth_operator.config import GROUP, PLURAL, VERSION, OperatorConfig
from mammoth_operator.coordination import Health, Retries, Serializer
from mammoth_operator.spec import InvalidSpec

FINALIZER = f"{GROUP}/finalizer"  # kept for the settings; no handler requires a finalizer
#: First retry delay (seconds) of a failed apply; doubled per retry up to :data:`MAX_RETRY_DELAY`.
APPLY_RETRY_DELAY = 2.0
MAX_RETRY_DELAY = 300.0
#: Seconds the liveness probe's own API call may take.
PROBE_TIMEOUT_SECONDS = 5.0


def backoff(retry: int) -> float:
    """Delay before retry number ``retry`` (0-based): 2, 4, 8 ... seconds, at most 300."""
    return min(APPLY_RETRY_DELAY * 2 ** retry, MAX_RETRY_DELAY)


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, config: OperatorConfig, **_: Any) -> None:
    """Settings of the whole operator, set once at startup."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    settings.watching.server_timeout = config.watch_server_timeout
    settings.watching.client_timeout = config.watch_client_timeout
    settings.watching.connect_timeout = config.watch_connect_timeout
    settings.networking.request_timeout = config.request_timeout
    settings.posting.level = logging.INFO
    settings.posting.reporting_component = "mammoth-operator"
    settings.execution.max_workers = 8
    settings.scanning.disabled = not config.scan_cluster
    # The children's lists and watches filtered by the API server on our label: the operator holds
    # only its own children (not every Secret of a namespace), and a child that loses the label is
    # seen as DELETED (the watch cache's rule for an object leaving a selector), so it is repaired.
    # kopf's handler filters alone saw an unlabelled child as not ours and never repaired it.
    children = {(kind.api_version, kind.plural) for kind in observed.CHILD_KINDS}
    selector = f"app.kubernetes.io/managed-by={builders.MANAGED_BY}"
    settings.watching.label_selectors[
        lambda resource: (f"{resource.group}/{resource.version}" if resource.group else resource.version,
                          resource.plural) in children] = selector
    memo.config = config
    memo.children = kube.Children(kube.new_api_client(), timeout=config.request_timeout)
    memo.serializer = Serializer()
    memo.health = Health()
    # shared by every handler call (kopf hands each a shallow copy of this memo: set nothing on those)
    memo.own_writes = observed.OwnWrites()
    memo.retries = Retries(APPLY_RETRY_DELAY, MAX_RETRY_DELAY)


def close(memo: kopf.Memo, **_: Any) -> None:
    """Cleanup: no retry of a repair runs after the operator stopped."""
    retries: Retries | None = getattr(memo, "retries", None)
    if retries is not None:
        retries.close()


def _announce(body: kopf.Body, outcome: convergence.Outcome, name: str) -> None:
    for result in outcome.results:
        if result.action == "created":
            kopf.info(body, reason="Created", message=f"Created {result.kind} {result.name}")
        elif result.action == "patched":
            fields = ", ".join(sorted(_paths(result.patch or {})))[:300]
            kopf.info(body, reason="Updated", message=f"Updated {result.kind} {result.name}: {fields}")
        if result.kind == "HorizontalPodAutoscaler" and result.action == "created":
            kopf.info(body, reason="Autoscaling", message=f"replicas of Deployment {result.name} are owned by "
                                                          f"HorizontalPodAutoscaler {result.name}")
    for ref in outcome.deleted:
        kopf.info(body, reason="Deleted", message=f"Deleted {ref.kind} {ref.name} (disabled in the spec)")


def reconcile(body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, logger: logging.Logger,
              retry: int = 0, **kwargs: Any) -> None:
    """Level-triggered reconcile for create, update and resume: make the children equal the spec.

    Raises:
        kopf.PermanentError: the spec is invalid (``Degraded/InvalidSpec``; retried when it changes).
        kopf.TemporaryError: a name conflict or a refused/failed API call (``Degraded/NameConflict`` or
            ``Degraded/ApplyFailed``), retried after :func:`backoff` seconds.
    """
    config: OperatorConfig = memo.config
    with memo.serializer.exclusive((namespace, name)), memo.health.running():
        indices = observed.indices_of(kwargs)
        view = observed.View(memo.children, indices, memo.own_writes)
        try:
            outcome = convergence.converge(view, body, config.images)
        except InvalidSpec as e:
            kopf.warn(body, reason="InvalidSpec", message=str(e))
            raise kopf.PermanentError(f"invalid spec: {e}") from e
        except kube.NameConflict as e:
            kopf.warn(body, reason="NameConflict", message=str(e))
            # a deleted pipeline's child goes with the garbage collector in moments; another owner's
            # object waits for a person (16, 32 ... s)
            raise kopf.TemporaryError(f"name conflict: {e}", delay=backoff(retry if e.previous else retry + 3)) from e
        except ApiException as e:
            if e.status == 400:  # a manifest the server cannot parse: only a spec change helps
                kopf.warn(body, reason="ApplyFailed", message=convergence.describe(e))
                raise kopf.PermanentError(f"applying children failed: {convergence.describe(e)}") from e
            kopf.warn(body, reason="ApplyFailed", message=convergence.describe(e))
            raise kopf.TemporaryError(f"applying children failed: {convergence.describe(e)}", delay=backoff(retry)) from e
        except Exception as e:  # timeouts, connection errors
            raise kopf.TemporaryError(f"applying children failed: {convergence.describe(e)}", delay=backoff(retry)) from e
    memo.health.succeeded()
    _announce(body, outcome, name)
    changed = [r for r in outcome.results if r.action != "unchanged"]
    logger.info("Reconciled generation %s: %d children, %d changed.", body["metadata"].get("generation"),
                len(outcome.results), len(changed))


def owner_name(body: Mapping[str, Any]) -> str | None:
    """Name of the MammothPipeline controlling a child (from its owner references), or None."""
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "MammothPipeline" and ref.get("apiVersion", "").startswith(f"{GROUP}/") and ref.get("controller"):
            return str(ref.get("name"))
    return None


def _request_repair(memo: kopf.Memo, indices: dict[str, Any], namespace: str, name: str, children: Iterable[Any],
                    logger: logging.Logger | None = None) -> None:
    """Converge ``children`` of pipeline ``namespace/name`` now, or after the convergence in flight
    (:class:`~mammoth_operator.coordination.Serializer`). A failure (a refused or timed-out call, a
    name conflict) is logged and retried with backoff, 2, 4, 8 ... s
    (:class:`~mammoth_operator.coordination.Retries`), as kopf retries the pipeline's own handler; the
    status says Degraded/ApplyFailed or NameConflict meanwhile. (An object that took a child's name
    without our label is invisible to the label-selected watch: only a retry sees it go.)"""
    log = logger or logging.getLogger(__name__)
    key = (namespace, name)

    def run(changed: frozenset[Any]) -> None:
        try:
            _repair(memo, indices, namespace, name, changed, log)
        except Exception as e:  # noqa: BLE001 - reported and retried
            delay = memo.retries.retry(key, changed, lambda again: _request_repair(memo, indices, namespace, name,
                                                                                    again, logger))
            log.warning("Repairing %s/%s failed (retried in %.0f s): %s", namespace, name, delay,
                        convergence.describe(e))
        else:
            memo.retries.succeeded(key)

    memo.serializer.request(key, list(children), run)


def _repair(memo: kopf.Memo, indices: dict[str, Any], namespace: str, name: str, changed: frozenset[Any],
            logger: logging.Logger) -> None:
    config: OperatorConfig = memo.config
    with memo.health.running():
        body = memo.children.read_pipeline(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        if (body.get("status") or {}).get("observedGeneration") != int(body["metadata"].get("generation") or 1):
            return  # the pipeline's own handler has this generation (with kopf's retries)
        view = observed.View(memo.children, indices, memo.own_writes)
        try:
            outcome = convergence.converge(view, body, config.images, only=changed)
        except InvalidSpec as e:  # the pipeline's own handler reports it; a spec change retries
            logger.warning("Pipeline %s/%s not repaired: %s", namespace, name, e)
            return
    memo.health.succeeded()
    for result in outcome.results:
        if result.action != "unchanged":
            kopf.warn(body, reason="Repaired", message=f"{result.action.capitalize()} {result.kind} {result.name} "
                                                       "(it drifted from the spec)")


def observe_child(type: str | None, body: kopf.Body, namespace: str, memo: kopf.Memo, logger: logging.Logger,
                  **kwargs: Any) -> None:
    """An owned child changed or went away: converge that child of its pipeline and write the status
    (coalesced per pipeline: events during a run make it run once more, with their children)."""
    name = owner_name(body) or (body.get("metadata", {}).get("labels") or {}).get("app.kubernetes.io/instance")
    if type is None or not name:
        return  # the initial listing: resume handlers converge every pipeline anyway
    child = (str(body.get("kind")), str(body["metadata"]["name"]))
    if type == "DELETED":
        memo.own_writes.forget((child[0], namespace, child[1]))
    _request_repair(memo, observed.indices_of(kwargs), namespace, name, [child], logger)


def probe_progress(memo: kopf.Memo, **_: Any) -> dict[str, Any]:
    """Liveness: one cheap API call, then the freshness of the last success.

    Raises:
        kopf.PermanentError: stuck (``/healthz`` answers 500 and the kubelet restarts the pod).
    """
    config: OperatorConfig = memo.config
    try:
        memo.children.ping(min(PROBE_TIMEOUT_SECONDS, config.request_timeout))
    except Exception as e:  # noqa: BLE001 - a failed call only makes the success older
        logging.getLogger(__name__).warning("liveness: the API server did not answer: %s", convergence.describe(e))
    else:
        memo.health.succeeded()
    problem = memo.health.problem(config.probe_stale_seconds)
    if problem is not None:
        raise kopf.PermanentError(problem)
    return {"ok": True}


def _paths(patch: Mapping[str, Any], prefix: str = "") -> list[str]:
    paths: list[str] = []
    for key, value in patch.items():
        if key == "metadata" and not prefix:
            continue
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping) and value:
            paths.extend(_paths(value, path))
        else:
            paths.append(path)
    return paths


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> kopf.OperatorRegistry:
    """Register every handler of the operator on ``registry`` with the given settings; returns it."""

    def configure_operator(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
        configure(settings=settings, memo=memo, config=config, **kwargs)

    kopf.on.startup(registry=registry, id="configure")(configure_operator)
    kopf.on.cleanup(registry=registry, id="close")(close)
    # A registry of our own gets no default login handler: authenticate like the API client does
    # (in-cluster service account, else the kubeconfig).
    kopf.on.login(registry=registry, id="login")(kopf.login_via_client)
    resource = (GROUP, VERSION, PLURAL)
    # counted and timed per run: mammoth_operator_reconciles_total / _reconcile_duration_seconds
    reconcile_timed = metrics.timed("reconcile")(reconcile)
    kopf.on.resume(*resource, registry=registry, id="reconcile")(reconcile_timed)
    kopf.on.create(*resource, registry=registry, id="reconcile")(reconcile_timed)
    kopf.on.update(*resource, registry=registry, id="reconcile")(reconcile_timed)
    observe_timed = metrics.timed("observe_child")(observe_child)
    managed = {"app.kubernetes.io/managed-by": builders.MANAGED_BY}
    for kind in observed.CHILD_KINDS:
        kopf.index(kind.api_version, kind.plural, registry=registry, id=kind.index_id, labels=managed)(
            observed.index_child)
        kopf.on.event(kind.api_version, kind.plural, registry=registry, id=f"observe_{kind.plural}",
                      labels=managed)(observe_timed)
    kopf.on.probe(registry=registry, id="progress")(probe_progress)
    return registry
