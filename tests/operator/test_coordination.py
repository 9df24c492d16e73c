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


def test_an_event_during_the_pipelines_own_handler_runs_once_it_ends():
    """A child event while the pipeline's own handler runs is handed to it, and repaired when it ends:
    the handler read that child before the event's change, so its convergence does not cover it.
    The serializer dropped the handed-over children (an exclusive run never ran them), so an edit by
    hand made during a reconcile was left in place until some later event of the same pipeline."""
    serializer = Serializer()
    runs: list[frozenset] = []
    with serializer.exclusive(KEY):
        serializer.request(KEY, [("Deployment", "tiny-ar")], runs.append)  # handed to the holder
        assert runs == []
    assert runs == [frozenset({("Deployment", "tiny-ar")})]
    with serializer.exclusive(KEY):  # nothing pending: nothing more runs
        pass
    serializer.request(KEY, [("Secret", "tiny-stage-tokens")], runs.append)
    assert runs == [frozenset({("Deployment", "tiny-ar")}), frozenset({("Secret", "tiny-stage-tokens")})]


def test_an_event_during_a_failing_handler_still_runs():
    serializer = Serializer()
    runs: list[frozenset] = []
    try:
        with serializer.exclusive(KEY):
            serializer.request(KEY, [("Service", "tiny-ar")], runs.append)
            raise RuntimeError("the apply failed")
    except RuntimeError:
        pass
    assert runs == [frozenset({("Service", "tiny-ar")})]


def test_retries_back_off_per_round_join_one_timer_and_stop_when_closed():
    """One retry round per timer: failures while it waits join it and do not lengthen the next delay
    (break-it pass: three events failing at once put the second round at 16 s instead of 4)."""
    from mammoth_operator.coordination import Retries

    fired: list[frozenset] = []
    done = threading.Event()

    def run(children):
        fired.append(children)
        done.set()

    retries = Retries(first_delay=0.05, max_delay=0.2)
    delays = []
    for round_ in range(4):
        done.clear()
        delays.append(retries.retry(KEY, [("Service", "tiny-ar")], run))
        delays.append(retries.retry(KEY, [("ConfigMap", "tiny-config")], run))  # joins the waiting timer
        assert done.wait(5)
    assert delays == [0.05, 0.05, 0.1, 0.1, 0.2, 0.2, 0.2, 0.2]  # doubling per round, at most max_delay
    assert fired == [frozenset({("Service", "tiny-ar"), ("ConfigMap", "tiny-config")})] * 4
    retries.succeeded(KEY)
    done.clear()
    assert retries.retry(KEY, [("Service", "tiny-ar")], run) == 0.05  # reset by a success
    retries.close()
    threading.Event().wait(0.3)
    assert len(fired) == 4 and not done.is_set()


def test_a_pipelines_state_is_forgotten_when_no_run_uses_it():
    """The serializer kept a lock and a run per pipeline for ever (break-it pass: 10 pipelines created
    and deleted left 10 of each)."""
    serializer = Serializer()
    for i in range(10):
        serializer.request(("default", f"p{i}"), [("Service", "x")], lambda items: None)
        with serializer.exclusive(("default", f"p{i}")):
            pass
    assert serializer.keys == 0
