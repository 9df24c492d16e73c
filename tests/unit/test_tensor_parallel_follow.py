"""The AR's rank-0-schedules / workers-follow protocol (`stage_ar.tensor_parallel_stage`) under
joins, cancellations, a failing sink and AR-side CFG, in one process.

Two real `DecodeEngine`s on the built-in tiny checkpoint (unsharded: this test is about who runs what
when, not the arithmetic, which `test_tensor_parallel.py` and the integration tests cover): rank 0's
with the `BroadcastingScheduler`, a follower's with the `FollowerScheduler`, each stepped by its own
thread. The turn headers and plans travel through `_QueueControl`, a stand-in for the ranks' groups
that hands each broadcast to the follower in order (the transport is not under test). Every header
carries rank 0's state before its turn and the follower raises `RankDesync` on any difference, so a follower
that ends cleanly ran exactly rank 0's turns; the rows rank 0 streams equal a job decoded alone.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading

import pytest
import torch

from stage_ar.engine import CollectingSink, DecodeJob, Role


@dataclasses.dataclass
class _Launch:
    rank: int


class _QueueControl:
    """In-order hand-over of rank 0's broadcasts (objects, and tensors as ``control.broadcast_``) to one
    follower: the role of the ranks' control and data groups."""

    def __init__(self, channel: queue.Queue, rank: int) -> None:
        self.channel, self.launch, self.control = channel, _Launch(rank), self

    def broadcast_object(self, obj=None):
        if self.launch.rank == 0:
            self.channel.put(obj)
            return obj
        return self.channel.get(timeout=30)

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.launch.rank == 0:
            self.channel.put(tensor.clone())
            return tensor
        return tensor.copy_(self.channel.get(timeout=30))


class _FailingSink(CollectingSink):
    """Raises on its ``n``-th ``put_rows`` (a push that broke mid-request)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def put_rows(self, role, hidden, token_ids) -> None:
        self.n -= 1
        if self.n == 0:
            raise ConnectionError("push stream broke")
        super().put_rows(role, hidden, token_ids)


def _job(bundle, key: str, w: int, h: int, sink, scale: float = 0.0) -> DecodeJob:
    tok = bundle.tokenizer
    return DecodeJob(request_id=key, epoch=0, prompt_ids=tok.encode_t2i_prompt(f"prompt {key}", w, h),
                     negative_ids=tok.encode_negative_prompt() if scale else None, ar_width=w, ar_height=h, seed=7,
                     temperature=1.0, top_k=0, top_p=0.0, ar_guidance_scale=scale, sink=sink,
                     on_progress=lambda done, total: None, on_done=lambda exc, stats: None)


@pytest.fixture(scope="module")
def bundles(tiny_checkpoint, tmp_path_factory):
    from stage_ar.loader import load_ar

    cache = str(tmp_path_factory.mktemp("cache"))
    return [load_ar(str(tiny_checkpoint), cache, "cpu", torch.float32) for _ in range(2)]


def test_follower_runs_rank0_turns_through_joins_cancels_and_a_failing_sink(bundles):
    from mammoth_core.settings import ARSettings
    from stage_ar.server import new_engine
    from stage_ar.tensor_parallel_stage import BroadcastingScheduler, FollowerScheduler, TurnPlan

    settings = ARSettings(max_running_sequences=4, max_sequence_length=256)
    channel: queue.Queue = queue.Queue()
    leader = new_engine(bundles[0], settings, warm_up=False,
                        scheduler_factory=functools.partial(BroadcastingScheduler, ranks=_QueueControl(channel, 0)))
    follower = new_engine(bundles[1], settings, warm_up=False,
                          scheduler_factory=functools.partial(FollowerScheduler, ranks=_QueueControl(channel, 1)))
    leader.scheduler.bind(leader)
    follower.scheduler.bind(follower)
    failure: list[BaseException] = []

    def follow() -> None:
        try:
            while True:
                follower.step()
        except Exception as exc:  # noqa: BLE001 - _StopFollowing ends it; anything else is the failure
            if type(exc).__name__ != "_StopFollowing":
                failure.append(exc)

    thread = threading.Thread(target=follow)
    thread.start()
    b0 = bundles[0]
    a, cfg, cancelled, broken = (CollectingSink(), CollectingSink(), CollectingSink(), _FailingSink(4))
    jobs = {"a": _job(b0, "a", 3, 2, a), "cfg": _job(b0, "cfg", 2, 2, cfg, scale=3.0),
            "cancelled": _job(b0, "cancelled", 4, 3, cancelled), "broken": _job(b0, "broken", 3, 3, broken)}
    leader.submit(jobs["a"])
    leader.step()
    leader.submit(jobs["cfg"])
    leader.submit(jobs["cancelled"])
    for _ in range(3):
        leader.step()
    jobs["cancelled"].cancel()
    leader.submit(jobs["broken"])
    leader.step_until_idle()
    leader.scheduler.send(TurnPlan(stop=True))
    thread.join(30)
    assert not thread.is_alive() and failure == []
    assert follower.runner.active_count == 0 and follower.scheduler.num_admitted == 0
    assert a.finished and cfg.finished and cancelled.aborted and broken.aborted
    assert jobs["broken"].cancelled.is_set()  # the failing sink became a cancellation (both ranks left)

    solo = new_engine(bundles[1], settings, warm_up=False)
    for key, sink in (("a", a), ("cfg", cfg)):
        alone = CollectingSink()
        solo.run_job(_job(b0, key, *((3, 2) if key == "a" else (2, 2)), alone, scale=3.0 if key == "cfg" else 0.0))
        assert sink.token_ids[Role.CONDITION] == alone.token_ids[Role.CONDITION], key
        assert torch.equal(sink.hidden(), alone.hidden()), key
