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


def test_an_own_write_stands_in_for_a_state_with_a_lower_generation_until_one_as_new_is_seen():
    from mammoth_operator.observed import OwnWrites

    writes = OwnWrites(patience=10.0, clock=lambda: 0.0)
    assert writes.stand_in(KEY, _child("5", 1)) is None  # nothing written
    writes.record(KEY, _child("7", 2, replicas=3))
    late = writes.stand_in(KEY, _child("6", 1))  # the controller's status write, before the operator's patch
    assert late is not None and late.obj["spec"]["replicas"] == 3 and late.recheck_in is None
    assert writes.stand_in(KEY, _child("9", 3, replicas=5)) is None  # a later spec change: believed
    assert writes.stand_in(KEY, _child("6", 1)) is None  # and the write is forgotten


def test_an_own_write_without_a_generation_stands_in_only_for_its_patience():
    from mammoth_operator.observed import OwnWrites

    now = [100.0]
    writes = OwnWrites(patience=10.0, clock=lambda: now[0])
    writes.record(KEY, _child("7"))
    now[0] = 104.0
    other = writes.stand_in(KEY, _child("6"))  # another version: older, or a change batched with the write's
    assert other is not None and other.recheck_in == 6.0
    assert writes.stand_in(KEY, None) is not None  # not in the index yet
    assert writes.stand_in(KEY, _child("7")) is None  # the write itself arrived: forgotten
    writes.record(KEY, _child("8"))
    now[0] = 118.5
    assert writes.stand_in(KEY, _child("6")) is None  # patience over: the observed state is believed
    writes.record(KEY, _child("9", 4))
    writes.forget(KEY)  # deleted
    assert writes.stand_in(KEY, None) is None


def test_a_view_reads_the_own_write_and_collects_the_uncertain_children():
    from mammoth_operator.observed import OwnWrites, View

    class Index(dict):
        def get(self, key, default=None):
            return super().get(key, default)

    deployments = Index({("default", "tiny-ar"): [_child("6", 1)]})
    indices = {f"{kind}_index": Index() for kind in ("secrets", "configmaps", "services", "poddisruptionbudgets",
                                                     "horizontalpodautoscalers", "networkpolicies")}
    indices["deployments_index"] = deployments
    writes = OwnWrites(patience=10.0, clock=lambda: 0.0)
    writes.record(KEY, _child("7", 2, replicas=3))
    writes.record(("Service", "default", "tiny-ar"), {"metadata": {"resourceVersion": "8"}, "spec": {}})
    view = View(children=None, indices=indices, own_writes=writes)
    assert view.get("Deployment", "default", "tiny-ar")["spec"]["replicas"] == 3
    assert view.get("Service", "default", "tiny-ar")["metadata"]["resourceVersion"] == "8"  # no GET
    assert view.rechecks == {("Service", "tiny-ar"): 10.0}
