"""The per-pipeline serializer: one convergence at a time, child events coalescing into one more run."""

from __future__ import annotations

import threading

from mammoth_operator.coordination import Serializer

KEY = ("default", "tiny")


def test_requests_during_a_run_make_it_run_once_more_with_every_child_handed_over():
    serializer = Serializer()
    runs: list[frozenset] = []
    inside, release = threading.Event(), threading.Event()

    def run(items: frozenset) -> None:
        runs.append(items)
        if len(runs) == 1:
            inside.set()
            assert release.wait(10)

    first = threading.Thread(target=serializer.request, args=(KEY, [("Deployment", "tiny-ar")], run))
    first.start()
    assert inside.wait(10)
    # two more events while the first run is in flight: handed over, not run by these callers
    serializer.request(KEY, [("Service", "tiny-gateway")], run)
    serializer.request(KEY, [("Deployment", "tiny-dit")], run)
    assert len(runs) == 1
    release.set()
    first.join(10)
    assert runs == [frozenset({("Deployment", "tiny-ar")}),
                    frozenset({("Service", "tiny-gateway"), ("Deployment", "tiny-dit")})]


def test_the_pipelines_own_handler_waits_for_a_run_and_drops_what_it_covers():
    serializer = Serializer()
    runs: list[frozenset] = []
    with serializer.exclusive(KEY):
        serializer.request(KEY, [("ConfigMap", "tiny-config")], runs.append)  # handed to the holder
        assert runs == []
    with serializer.exclusive(KEY):  # a full convergence covers every child: the pending one is dropped
        pass
    serializer.request(KEY, [("Secret", "tiny-stage-tokens")], runs.append)
    assert runs == [frozenset({("Secret", "tiny-stage-tokens")})]
