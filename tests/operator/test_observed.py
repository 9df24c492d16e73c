"""Children are observed through kopf's indexes (one per child kind), not read from the API."""

from __future__ import annotations

from emulator_harness import CHILD_RESOURCES, PIPELINES, OperatorProcess, example_pipeline, wait_for
from test_operator import wait_applied


def test_resume_over_existing_children_reads_none_of_them(api, crd_installed, operator_log, emulator):
    operator = OperatorProcess(operator_log)
    operator.start()
    try:
        assert api.create(PIPELINES, example_pipeline()).status_code in (200, 201)
        wait_applied(api, "tiny", 1)
    finally:
        operator.stop()

    since = len(emulator.reads)
    operator = OperatorProcess(operator_log)
    operator.start()
    try:
        wait_for(lambda: "Reconciled generation 1: 12 children, 0 changed." in operator_log.text(), timeout=30,
                 what="the resumed pipeline converged")
    finally:
        operator.stop()
    child_reads = [r for r in emulator.reads[since:] if r[0] in CHILD_RESOURCES]
    assert child_reads == []  # every child and the status's Deployments came from the indexes


def _child(rv: str, generation: int | None = None, replicas: int = 1) -> dict:
    meta = {"name": "tiny-ar", "namespace": "default", "resourceVersion": rv}
    if generation is not None:
        meta["generation"] = generation
    return {"metadata": meta, "spec": {"replicas": replicas}}


KEY = ("Deployment", "default", "tiny-ar")


def test_an_own_write_is_read_for_a_state_with_a_lower_generation_until_one_as_new_is_seen():
    from mammoth_operator.observed import CURRENT, OLDER, OwnWrites

    writes = OwnWrites(patience=10.0, clock=lambda: 0.0)
    assert writes.judge(KEY, _child("5", 1)) == (CURRENT, None)  # nothing written
    writes.record(KEY, _child("7", 2, replicas=3))
    verdict, written = writes.judge(KEY, _child("6", 1))  # the controller's status write, before the patch
    assert verdict == OLDER and written["spec"]["replicas"] == 3
    assert writes.judge(KEY, _child("9", 3, replicas=5)) == (CURRENT, None)  # a later spec change: believed
    assert writes.judge(KEY, _child("6", 1)) == (CURRENT, None) and len(writes) == 0  # and the write forgotten


def test_the_same_generation_is_current_only_with_the_writes_labels_and_applied_record():
    """A write that changed only metadata (autoscaling on: only the applied record) keeps the
    generation: a late state of that generation with the old record cannot be ordered by the objects."""
    from mammoth_operator.kube import LAST_APPLIED_ANNOTATION
    from mammoth_operator.observed import CURRENT, UNKNOWN, OwnWrites

    def annotated(rv: str, record: str) -> dict:
        child = _child(rv, 4)
        child["metadata"]["annotations"] = {LAST_APPLIED_ANNOTATION: record, "deployment.kubernetes.io/revision": rv}
        return child

    writes = OwnWrites(patience=10.0, clock=lambda: 0.0)
    writes.record(KEY, annotated("7", "new"))
    assert writes.judge(KEY, annotated("6", "old"))[0] == UNKNOWN
    assert writes.judge(KEY, annotated("8", "new")) == (CURRENT, None)  # a status write after it


def test_an_own_write_without_a_generation_cannot_be_ordered_and_is_kept_for_its_patience():
    from mammoth_operator.observed import CURRENT, UNKNOWN, OwnWrites

    now = [100.0]
    writes = OwnWrites(patience=10.0, clock=lambda: now[0])
    writes.record(KEY, _child("7"))
    assert writes.judge(KEY, _child("6"))[0] == UNKNOWN  # older, or a change batched with the write's event
    assert writes.judge(KEY, None)[0] == UNKNOWN  # not in the index yet
    assert writes.judge(KEY, _child("7")) == (CURRENT, None)  # the write itself arrived: forgotten
    writes.record(KEY, _child("8"))
    now[0] = 110.5
    assert writes.judge(KEY, _child("6")) == (CURRENT, None) and len(writes) == 0  # patience over
    writes.record(KEY, _child("9", 4))
    writes.forget(KEY)  # deleted
    assert len(writes) == 0


def test_a_view_reads_the_own_write_for_an_older_index_state_and_the_api_where_it_cannot_tell():
    from mammoth_operator.observed import OwnWrites, View

    class Index(dict):
        def get(self, key, default=None):
            return super().get(key, default)

    class Api:  # the API client's read, counted
        def __init__(self):
            self.reads = []

        def read(self, api_version, kind, namespace, name):
            self.reads.append((kind, name))
            return {"metadata": {"resourceVersion": "11"}, "spec": {"from": "the API"}}

    indices = {f"{kind}_index": Index() for kind in ("secrets", "configmaps", "poddisruptionbudgets",
                                                     "horizontalpodautoscalers", "networkpolicies")}
    indices["deployments_index"] = Index({("default", "tiny-ar"): [_child("6", 1)]})
    indices["services_index"] = Index({("default", "tiny-ar"): [{"metadata": {"resourceVersion": "5"}}]})
    writes = OwnWrites(patience=10.0, clock=lambda: 0.0)
    writes.record(KEY, _child("7", 2, replicas=3))
    writes.record(("Service", "default", "tiny-ar"), {"metadata": {"resourceVersion": "8"}, "spec": {}})
    api = Api()
    view = View(children=api, indices=indices, own_writes=writes)
    assert view.get("Deployment", "default", "tiny-ar")["spec"]["replicas"] == 3  # the write, no read
    assert view.get("Service", "default", "tiny-ar")["spec"] == {"from": "the API"}
    assert view.get("Service", "default", "tiny-ar")["spec"] == {"from": "the API"}  # read once per convergence
    assert api.reads == [("Service", "tiny-ar")]
