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
