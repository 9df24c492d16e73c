"""kopf handlers of the ``MammothPipeline`` operator.

One concern per handler:

* :func:`configure` (startup): kopf settings (own finalizer and annotation prefixes, progress kept in
  annotations, watch timeouts, events) and the API client.
* :func:`reconcile` (create, update, resume): validate the spec, build the full desired set of
  children, create or patch them, write ``observedGeneration`` and the conditions.
* :func:`report_status` (timer): refresh the status from the observed children.

Handlers are registered on an explicit registry by :func:`register`, so the process entry point (and
the tests) choose the settings; nothing registers on import.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from mammoth_operator import builders, kube, metrics
from mammoth_operator import status as pipeline_status
from mammoth_operator.config import GROUP, PLURAL, VERSION, OperatorConfig
from mammoth_operator.spec import InvalidSpec, PipelineSpec, parse_spec

FINALIZER = f"{GROUP}/finalizer"
#: Seconds before retrying an apply the API server refused for a transient reason.
APPLY_RETRY_DELAY = 10


def observe(children: kube.Children, namespace: str, name: str, autoscaled: frozenset[str]) -> pipeline_status.Observed:
    """Read the children the status is computed from: three Deployments and the gateway Service."""
    names = builders.child_names(name)
    deployments = {
        component: children.read("apps/v1", "Deployment", namespace, child)
        for component, child in (("ar", names.ar), ("dit", names.dit), ("gateway", names.gateway))
    }
    service = children.read("v1", "Service", namespace, names.gateway)
    return pipeline_status.Observed(deployments=deployments, gateway_service=service, autoscaled=autoscaled)


def _autoscaled(spec: PipelineSpec) -> frozenset[str]:
    return frozenset(stage.component for stage in (spec.ar, spec.dit) if stage.autoscaling.enabled)


def status_changes(current: Mapping[str, Any] | None, generation: int, observed_generation: int | None,
                   observed: pipeline_status.Observed, problem: pipeline_status.Problem | None,
                   applied: bool) -> dict[str, Any]:
    """The status keys that changed (empty when nothing changed).

    ``current`` must be a snapshot taken when the handler started (kopf's ``status`` is a live view).
    Only the reconcile (``applied``) writes ``observedGeneration``; the timer never moves it.
    """
    desired = pipeline_status.compute_status(generation, observed_generation, observed, problem)
    desired["conditions"] = pipeline_status.merge_conditions((current or {}).get("conditions"), desired["conditions"],
                                                             pipeline_status.now_iso())
    if applied:
        desired["observedGeneration"] = generation
    return pipeline_status.status_changes(current, desired)


def _snapshot(status: Mapping[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(dict(status))


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
    memo.config = config
    memo.children = kube.Children(kube.new_api_client())


def reconcile(body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, name: str, namespace: str,
              uid: str, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Level-triggered reconcile for create, update and resume: make the children equal the spec.

    Raises:
        kopf.PermanentError: the spec is invalid or the API server rejected a child as invalid
            (reported as ``Degraded`` with a reason; retried only when the spec changes).
        kopf.TemporaryError: a transient API failure (retried after :data:`APPLY_RETRY_DELAY`).
    """
    config: OperatorConfig = memo.config
    children: kube.Children = memo.children
    current = _snapshot(status)
    generation = int(meta.get("generation") or 1)
    try:
        pipeline = parse_spec(name, namespace, spec, config.images)
    except InvalidSpec as e:
        problem = pipeline_status.Problem("InvalidSpec", str(e))
        observed = observe(children, namespace, name, frozenset())
        # kopf drops a failed handler's patch: write this status directly, then fail permanently.
        children.patch_pipeline_status(namespace, name, status_changes(
            current, generation, generation, observed, problem, applied=True))
        kopf.warn(body, reason="InvalidSpec", message=str(e))
        raise kopf.PermanentError(f"invalid spec: {e}") from e

    desired = builders.build_children(pipeline)
    kopf.adopt([child.manifest for child in desired], owner=body)
    try:
        results = [kube.apply(children, child) for child in desired]
        deleted = kube.delete_unwanted(children, namespace, uid, builders.unwanted_children(pipeline))
    except ApiException as e:
        message = f"{e.status} {e.reason}: {(e.body or '')[:500]}"
        permanent = e.status in (400, 403, 422)
        problem = pipeline_status.Problem("ApplyFailed", message)
        children.patch_pipeline_status(namespace, name, status_changes(
            current, generation, current.get("observedGeneration"),
            observe(children, namespace, name, _autoscaled(pipeline)), problem, applied=False))
        kopf.warn(body, reason="ApplyFailed", message=message)
        if permanent:
            raise kopf.PermanentError(f"applying children failed: {message}") from e
        raise kopf.TemporaryError(f"applying children failed: {message}", delay=APPLY_RETRY_DELAY) from e

    for result in results:
        if result.action == "created":
            kopf.info(body, reason="Created", message=f"Created {result.kind} {result.name}")
        elif result.action == "patched":
            fields = ", ".join(sorted(_paths(result.patch or {})))[:300]
            kopf.info(body, reason="Updated", message=f"Updated {result.kind} {result.name}: {fields}")
    for ref in deleted:
        kopf.info(body, reason="Deleted", message=f"Deleted {ref.kind} {ref.name} (disabled in the spec)")
    for stage in (pipeline.ar, pipeline.dit):
        if stage.autoscaling.enabled and any(r.kind == "HorizontalPodAutoscaler" and r.action == "created" for r in results):
            kopf.info(body, reason="Autoscaling",
                      message=f"{stage.component} replicas are owned by HorizontalPodAutoscaler "
                              f"{getattr(builders.child_names(name), stage.component)}")
    changed = [r for r in results if r.action != "unchanged"]
    logger.info("Reconciled generation %s: %d children, %d changed.", generation, len(results), len(changed))
    patch.status.update(status_changes(current, generation, generation,
                                       observe(children, namespace, name, _autoscaled(pipeline)), None, applied=True))


def report_status(spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, name: str, namespace: str,
                  patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    """Refresh conditions, replica counts and the endpoint from the children (never touches them)."""
    config: OperatorConfig = memo.config
    current = _snapshot(status)
    generation = int(meta.get("generation") or 1)
    observed_generation = current.get("observedGeneration")
    problem: pipeline_status.Problem | None = None
    autoscaled: frozenset[str] = frozenset()
    try:
        autoscaled = _autoscaled(parse_spec(name, namespace, spec, config.images))
    except InvalidSpec as e:
        problem = pipeline_status.Problem("InvalidSpec", str(e))
    else:
        degraded = pipeline_status.condition(current, "Degraded")
        if (degraded and degraded.get("reason") == "ApplyFailed"
                and (observed_generation is None or observed_generation < generation)):
            problem = pipeline_status.Problem("ApplyFailed", str(degraded.get("message") or ""))
    patch.status.update(status_changes(current, generation, observed_generation,
                                       observe(memo.children, namespace, name, autoscaled), problem, applied=False))


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
    # A registry of our own gets no default login handler: authenticate like the API client does
    # (in-cluster service account, else the kubeconfig).
    kopf.on.login(registry=registry, id="login")(kopf.login_via_client)
    resource = (GROUP, VERSION, PLURAL)
    # counted and timed per run: mammoth_operator_reconciles_total / _reconcile_duration_seconds
    reconcile_timed = metrics.timed("reconcile")(reconcile)
    kopf.on.resume(*resource, registry=registry, id="reconcile")(reconcile_timed)
    kopf.on.create(*resource, registry=registry, id="reconcile")(reconcile_timed)
    kopf.on.update(*resource, registry=registry, id="reconcile")(reconcile_timed)
    kopf.timer(*resource, registry=registry, id="report_status", interval=config.status_interval_seconds,
               initial_delay=min(1.0, config.status_interval_seconds))(metrics.timed("report_status")(report_status))
    return registry
