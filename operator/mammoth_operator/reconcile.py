"""One convergence of a pipeline, shared by the pipeline's own handlers and the child handlers.

:func:`converge` parses the spec (the CRD's rules), builds the desired children, reads them from the
:class:`~mammoth_operator.observed.View` (kopf's indexes), refuses objects it does not own
(``NameConflict``), reports a missing child (``Degraded/ChildMissing``) before recreating it,
creates or patches every child that differs, deletes the optional ones the spec no longer wants, and
writes the status through :func:`write_status`, the one status writer. It is level-triggered:
called again with nothing changed, it writes nothing. A child event converges only the children it
names (``only``), so a child is compared with the state its own event delivered.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import copy
import dataclasses
import logging
import secrets
from collections.abc import Collection, Mapping
from typing import Any

import kopf

from mammoth_operator import builders, kube
from mammoth_operator import status as pipeline_status
from mammoth_operator.observed import View
from mammoth_operator.spec import ROLE_TOKEN_KEYS, InvalidSpec, PipelineSpec, parse_spec

logger = logging.getLogger(__name__)

#: Bytes of randomness per generated stage token (URL-safe base64: 43 characters).
TOKEN_BYTES = 32


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one convergence did: the apply results and the optional children deleted."""

    results: list[kube.ApplyResult]
    deleted: list[builders.ChildRef]


def _autoscaled(spec: PipelineSpec) -> frozenset[str]:
    return frozenset(stage.component for stage in (spec.ar, spec.dit) if stage.autoscaling.enabled)


def write_status(view: View, body: Mapping[str, Any], problem: pipeline_status.Problem | None,
                 autoscaled: frozenset[str], applied: bool) -> None:
    """The one status writer: compute the status of the pipeline ``body`` from its three Deployments
    and the gateway Service as ``view`` observes them now, and patch the keys that changed (nothing
    when none did). Only an ``applied`` convergence writes ``observedGeneration``.

    Raises:
        kubernetes.client.exceptions.ApiException: the status patch was refused.
    """
    meta = body.get("metadata") or {}
    namespace, name = meta["namespace"], meta["name"]
    names = builders.child_names(name)
    observed = pipeline_status.Observed(  # as indexed (or written): no API read, so a failing read still gets a status
        deployments={c: view.indexed("Deployment", namespace, names.component(c)) for c in pipeline_status.COMPONENTS},
        gateway_service=view.indexed("Service", namespace, names.gateway),
        autoscaled=autoscaled,
    )
    current = copy.deepcopy(dict(body.get("status") or {}))
    changes = pipeline_status.status_patch(current, int(meta.get("generation") or 1), observed, problem, applied,
                                           pipeline_status.now_iso())
    view.children.patch_pipeline_status(namespace, name, changes)


def stage_tokens(observed_secret: Mapping[str, Any] | None) -> dict[str, str]:
    """The tokens of the generated Secret as read, or fresh random ones (role -> token) when it is
    absent or unreadable (then it is recreated and the pods roll)."""
    data = (observed_secret or {}).get("data") or {}
    try:
        tokens = {role: base64.b64decode(data[key], validate=True).decode() for role, key in ROLE_TOKEN_KEYS.items()}
    except (KeyError, binascii.Error, UnicodeDecodeError):
        return {role: secrets.token_urlsafe(TOKEN_BYTES) for role in ROLE_TOKEN_KEYS}
    return tokens


def _desired(view: View, body: Mapping[str, Any], pipeline: PipelineSpec) -> list[builders.Child]:
    """Every desired child, adopted (namespace, owner reference, labels) and with the stage tokens of
    the Secret this pipeline controls (fresh ones when there is none)."""
    meta = body["metadata"]
    tokens = None
    if pipeline.transport.generated_role_tokens:
        secret = view.get("Secret", meta["namespace"], builders.child_names(meta["name"]).stage_tokens)
        tokens = stage_tokens(secret if secret is None or kube.controlled_by(secret, meta["uid"]) else None)
    desired = builders.build_children(pipeline, tokens)
    kopf.adopt([child.manifest for child in desired], owner=dict(body))
    return desired


def _targets(desired: list[builders.Child], only: Collection[tuple[str, str]] | None) -> list[builders.Child]:
    """The children to converge: all of them, or those ``only`` names. A change of the token Secret
    converges all (new tokens roll every Deployment)."""
    if only is None or any(kind == "Secret" for kind, _ in only):
        return desired
    return [child for child in desired if (child.kind, child.name) in only]


def _apply(view: View, body: Mapping[str, Any], targets: list[builders.Child], unwanted: list[builders.ChildRef],
           observed: Mapping[tuple[str, str], Any]) -> Outcome:
    namespace, uid = body["metadata"]["namespace"], body["metadata"]["uid"]
    results = []
    for child in targets:
        result = kube.apply(view.children, child, observed[(child.kind, child.name)], uid)
        view.wrote(child.kind, namespace, child.name, result.obj, sent=result.action != "unchanged")
        results.append(result)
    gone = [(ref, view.indexed(ref.kind, namespace, ref.name)) for ref in unwanted]
    deleted = kube.delete_unwanted(view.children, namespace, uid, gone)
    for ref in deleted:
        view.wrote(ref.kind, namespace, ref.name, None)
    return Outcome(results, deleted)


def converge(view: View, body: Mapping[str, Any], images: Mapping[str, str],
             only: Collection[tuple[str, str]] | None = None) -> Outcome:
    """Make the children of the pipeline ``body`` (all, or the ``(kind, name)`` pairs in ``only``)
    equal its spec, then write its status.

    Raises:
        InvalidSpec: the spec breaks a rule (status written: ``Degraded/InvalidSpec``).
        kube.NameConflict: a child's name is taken by an object this pipeline does not control
            (status written: ``Degraded/NameConflict``; nothing is touched).
        kubernetes.client.exceptions.ApiException, urllib3 errors: the API refused or timed out
            (status written, when possible: ``Degraded/ApplyFailed``).
    """
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    try:
        pipeline = parse_spec(name, namespace, body.get("spec"), images)
    except InvalidSpec as e:
        write_status(view, body, pipeline_status.Problem("InvalidSpec", str(e)), frozenset(), applied=True)
        raise
    autoscaled = _autoscaled(pipeline)
    try:  # reading may call the API (a child no index holds, or one it cannot order: `View`)
        targets = _targets(_desired(view, body, pipeline), only)
        observed = {(c.kind, c.name): view.get(c.kind, namespace, c.name) for c in targets}
    except Exception as e:
        with contextlib.suppress(Exception):
            write_status(view, body, pipeline_status.Problem("ApplyFailed", describe(e)), autoscaled, applied=False)
        raise
    unwanted = [r for r in builders.unwanted_children(pipeline) if only is None or (r.kind, r.name) in only]
    missing = [f"{c.kind} {c.name}" for c in targets if observed[(c.kind, c.name)] is None]
    if missing and (body.get("status") or {}).get("observedGeneration") == int(meta.get("generation") or 1):
        message = f"{', '.join(missing)} missing (deleted by hand?); recreating"
        write_status(view, body, pipeline_status.Problem("ChildMissing", message), autoscaled, applied=False)
        kopf.warn(dict(body), reason="ChildMissing", message=message)
    try:
        outcome = _apply(view, body, targets, unwanted, observed)
    except kube.NameConflict as e:
        write_status(view, body, pipeline_status.Problem("NameConflict", str(e)), autoscaled, applied=False)
        raise
    except Exception as e:
        with contextlib.suppress(Exception):
            write_status(view, body, pipeline_status.Problem("ApplyFailed", describe(e)), autoscaled, applied=False)
        raise
    write_status(view, body, None, autoscaled, applied=True)
    return outcome


def describe(error: BaseException) -> str:
    """A short message for an API failure (status code, reason and the start of the server's answer)."""
    status = getattr(error, "status", None)
    if status is not None:
        return f"{status} {getattr(error, 'reason', '')}: {(getattr(error, 'body', None) or '')[:400]}"
    return f"{type(error).__name__}: {str(error)[:400]}"
