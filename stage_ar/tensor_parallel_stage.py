"""The AR stage over ``tensor_parallel_size`` GPUs (issue 21): rank 0 schedules, every rank steps.

``mammoth ar --tensor-parallel-size N`` starts ranks ``1..N-1`` itself (`mammoth_core.rank_group`);
each rank loads only its shard of the model (`stage_ar.loader.load_ar` with ``tensor_parallel``: read
into host memory, sharded by `stage_ar.tensor_parallel.shard_ar_model_`, the shard moved to the rank's
GPU, FP8 conversion after that). Rank 0 is the stage: gRPC, the `DecodeEngine` and its scheduler, the
hidden-state sender. The other ranks run the same `DecodeEngine` with a `FollowerScheduler` and no
network at all.

Why this split (vLLM's: the scheduler on one rank, the workers execute its decisions): every input
of an engine turn that is not a pure function of the model is a scheduler decision — which requests
join (with their KV slots), which leave (cancelled, past their deadline, push failed). Rank 0's
`BroadcastingScheduler` makes those decisions as always and broadcasts them before the turn runs,
host to host over the gloo control group: every turn a three-number header, and only on turns where
requests join or leave a pickled `TurnPlan` (a pickled broadcast is two collectives and a pickle:
three times the header's cost on this project's loaded CPU host). Host-only on purpose: rank 0's host
runs a step ahead of its GPU (the one-step-late readback) and so does a worker's, so neither GPU
waits for the other's host; a header on the NCCL stream would make each worker wait for rank 0's
previous step before it could launch the next. A `FollowerScheduler` returns exactly those decisions, so each rank's engine runs the same prefills, steps and leaves in the same order and
meets the same all-reduces (two per layer, `shard_ar_model_`). Sampling needs no exchange: the
all-reduced hidden states and the replicated heads are bit-identical on every rank (tested), so every
rank draws the same token with the request's seeded sampler. Rank 0's host-side events that would
change its runner mid-turn (a sink or progress callback that raises) are turned into cancellations,
which the next plan carries. Each header also carries rank 0's runner state before the turn (active
requests, requests known to the workers); a worker that differs raises `RankDesync` and exits, which
fails the stage: a desynchronised rank is never left to compute garbage.

Idle, rank 0's engine turns every 50 ms (`DecodeEngine`'s wait), so a plan reaches the workers at
least that often: the collective timeout (``distributed_timeout_seconds``) bounds every wait.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Any, Callable

from mammoth_core.rank_group import JoinedRanks, RankGroup, RankLaunch, join_ranks
from stage_ar.engine_io import DecodeJob
from stage_ar.scheduler import (
    ARScheduler, EngineCancelled, RequestState, SchedulerOutput, SchedulerRequest,
)

__all__ = ["BroadcastingScheduler", "FollowerScheduler", "RankDesync", "TensorParallelAR", "TurnPlan", "run_worker"]

logger = logging.getLogger(__name__)

#: `DecodeJob` fields that stay on rank 0 (callbacks, the sink, clocks); every other field is the
#: request's data and travels to the workers (a new field that cannot be pickled fails loudly).
_RANK0_FIELDS = frozenset({"sink", "on_progress", "on_done", "deadline", "row_times", "cancelled", "cancel_callbacks"})


class RankDesync(RuntimeError):
    """A worker's engine state differs from rank 0's at the start of a turn."""


class _StopFollowing(Exception):
    """Rank 0 stopped its engine: the worker's loop ends."""


@dataclasses.dataclass
class TurnPlan:
    """Rank 0's scheduler decisions for one engine turn.

    Attributes:
        admitted: ``(key, job data, first KV slot)`` per request joining now, in admission order.
        aborted: keys of admitted requests leaving now (cancelled, past their deadline).
        state: rank 0's ``(active requests in the runner, requests known to the workers)`` before
            this turn's changes.
        stop: rank 0's engine stopped; the workers exit.
    """

    admitted: list[tuple[int, dict[str, Any], int]] = dataclasses.field(default_factory=list)
    aborted: list[int] = dataclasses.field(default_factory=list)
    state: tuple[int, int] = (0, 0)
    stop: bool = False


#: The turn header's first value (``[kind, active requests, requests known to the workers]``, int64
#: on the host): nothing changes, a pickled `TurnPlan` follows, or rank 0 stopped.
_EMPTY, _PLAN, _STOP = 0, 1, 2


def _header(*values: int) -> Any:
    import torch

    return torch.tensor(values or (0, 0, 0), dtype=torch.long)


def job_data(job: DecodeJob) -> dict[str, Any]:
    """The fields of ``job`` a worker needs to build the same sequence (see `_RANK0_FIELDS`)."""
    return {f.name: getattr(job, f.name) for f in dataclasses.fields(DecodeJob) if f.name not in _RANK0_FIELDS}


class _DiscardingSink:
    """A worker's sink: rows are rank 0's to send."""

    def put_rows(self, role, hidden, token_ids) -> None:  # noqa: ANN001 - RowSink
        pass

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _no_op(*_args: Any) -> None:
    pass


def job_from_data(data: dict[str, Any]) -> DecodeJob:
    """A worker's copy of a rank-0 job: the same data, a discarding sink, no callbacks."""
    return DecodeJob(**data, sink=_DiscardingSink(), on_progress=_no_op, on_done=_no_op)


class _CancellingSink:
    """Rank 0's sink wrapper: a failing ``put_rows`` cancels the job (the next plan carries it)
    instead of failing it mid-turn, which would change rank 0's runner alone."""

    def __init__(self, job: DecodeJob) -> None:
        self.inner, self.job = job.sink, job

    def put_rows(self, role, hidden, token_ids) -> None:  # noqa: ANN001 - RowSink
        try:
            self.inner.put_rows(role, hidden, token_ids)
        except Exception:  # noqa: BLE001
            logger.exception("sink of %s failed; cancelling it", self.job.request_id)
            self.job.cancel()

    def finish(self) -> None:
        self.inner.finish()

    def abort(self) -> None:
        self.inner.abort()


def _guard_callbacks(job: DecodeJob) -> None:
    job.sink = _CancellingSink(job)
    progress = job.on_progress

    def on_progress(done: int, total: int) -> None:
        try:
            progress(done, total)
        except Exception:  # noqa: BLE001
            logger.exception("progress callback of %s failed; cancelling it", job.request_id)
            job.cancel()

    job.on_progress = on_progress


class BroadcastingScheduler(ARScheduler):
    """Rank 0's `ARScheduler`: each `schedule` also broadcasts its decisions as a `TurnPlan`.

    Args:
        num_slots, slot_capacity, max_running_sequences: as `ARScheduler`.
        ranks: the joined ranks (control group; a failed broadcast ends the stage there).

    Attributes:
        last_turn: `time.monotonic` of the latest `schedule` (the engine's turn; rank 0's watchdog).
    """

    def __init__(self, num_slots: int, slot_capacity: int, max_running_sequences: int, *,
                 ranks: JoinedRanks) -> None:
        super().__init__(num_slots, slot_capacity, max_running_sequences)
        self._ranks = ranks
        self.last_turn = time.monotonic()
        self._keys: dict[SchedulerRequest, int] = {}
        self._next_key = 0
        self._active: Callable[[], int] = lambda: 0

    def bind(self, engine: Any) -> None:
        """Read the runner's active count from ``engine`` (built after its scheduler)."""
        self._active = lambda: engine.runner.active_count

    def schedule(self) -> SchedulerOutput:
        self.last_turn = time.monotonic()
        state = (self._active(), len(self._keys))
        out = super().schedule()
        plan = TurnPlan(aborted=[self._keys.pop(r) for r in out.aborted if r in self._keys], state=state)
        for request in out.admitted:
            key, self._next_key = self._next_key, self._next_key + 1
            self._keys[request] = key
            job = request.payload.job
            _guard_callbacks(job)
            plan.admitted.append((key, job_data(job), request.first_slot))
        self.send(plan)
        return out

    def send(self, plan: TurnPlan) -> None:
        """Broadcast ``plan``: always the turn header, the pickled plan only when requests join or
        leave (both over the control group). A failure ends the stage (the groups' ``on_failure``)."""
        kind = _STOP if plan.stop else _PLAN if plan.admitted or plan.aborted else _EMPTY
        self._ranks.control.broadcast_(_header(kind, *plan.state))
        if kind == _PLAN:
            self._ranks.broadcast_object(plan)

    def finish(self, request: SchedulerRequest) -> None:
        super().finish(request)
        self._keys.pop(request, None)


class FollowerScheduler:
    """A worker's scheduler: `schedule` returns rank 0's decisions (`TurnPlan`), nothing else.

    Same interface as `ARScheduler` as far as `DecodeEngine` uses it.

    Raises (from `schedule`):
        RankDesync: the worker's state before the turn differs from rank 0's.
    """

    def __init__(self, num_slots: int, slot_capacity: int, max_running_sequences: int, *,
                 ranks: JoinedRanks) -> None:
        self._ranks = ranks
        self._by_key: dict[int, SchedulerRequest] = {}
        self._keys: dict[SchedulerRequest, int] = {}
        self._running: list[SchedulerRequest] = []
        self._incoming: SchedulerRequest | None = None
        self._engine: Any = None

    def bind(self, engine: Any) -> None:
        """The engine whose `submit` builds each admitted job's run."""
        self._engine = engine

    @property
    def num_admitted(self) -> int:
        return len(self._running)

    @property
    def running(self) -> list[SchedulerRequest]:
        return list(self._running)

    def add(self, request: SchedulerRequest) -> None:
        self._incoming = request

    def abort(self, request: SchedulerRequest, reason: BaseException | None = None) -> bool:
        return False  # a worker's jobs are never cancelled locally: rank 0's plan says who leaves

    def stop_accepting(self) -> None:
        pass

    def wait_for_work(self, timeout: float) -> bool:
        return True  # the plan's broadcast is the wait

    def schedule(self) -> SchedulerOutput:
        kind, *state = self._ranks.control.broadcast_(_header()).tolist()
        if kind == _STOP:
            raise _StopFollowing
        mine = [self._engine.runner.active_count, len(self._by_key)]
        if mine != state:
            raise RankDesync(f"rank {self._ranks.launch.rank} has (active, known) = {mine}, rank 0 {state}")
        if kind == _EMPTY:
            return SchedulerOutput([], [])
        plan: TurnPlan = self._ranks.broadcast_object()
        aborted = [self._leave(key) for key in plan.aborted]
        admitted = []
        for key, data, first in plan.admitted:
            self._engine.submit(job_from_data(data))  # builds the run; `add` hands us its request
            request, self._incoming = self._incoming, None
            request.first_slot, request.state = first, RequestState.RUNNING
            self._by_key[key], self._keys[request] = request, key
            self._running.append(request)
            admitted.append(request)
        return SchedulerOutput(aborted, admitted)

    def _leave(self, key: int) -> SchedulerRequest:
        request = self._by_key.pop(key, None)
        if request is None:
            raise RankDesync(f"rank 0 aborted request key {key}, unknown to rank {self._ranks.launch.rank}")
        self._keys.pop(request)
        self._running.remove(request)
        request.state, request.first_slot = RequestState.ABORTED, None
        request.abort_reason = EngineCancelled(request.request_id)
        return request

    def finish(self, request: SchedulerRequest) -> None:
        key = self._keys.pop(request, None)
        if key is not None:
            self._by_key.pop(key)
            self._running.remove(request)
            request.state = RequestState.FINISHED

    def drain_all(self, reason: BaseException) -> list[SchedulerRequest]:
        out, self._running = self._running, []
        self._by_key.clear()
        self._keys.clear()
        return out


def _load(settings: Any, ranks: JoinedRanks) -> Any:
    from stage_ar.loader import load_ar

    return load_ar(settings.checkpoint, settings.cache_dir, ranks.launch.rank_device, settings.resolved_dtype(),
                   weights_dtype=settings.weights_dtype, linear_backend=settings.linear_backend,
                   tensor_parallel=ranks.data)


def run_worker(launch: RankLaunch, settings: Any) -> None:
    """A worker rank (``launch.rank >= 1``): join, load the shard, follow rank 0's engine until it
    stops. Raises on any failure (the process then exits non-zero, which fails the stage)."""
    import torch

    from stage_ar.server import new_engine

    if settings.torch_threads:
        torch.set_num_threads(int(settings.torch_threads))
    ranks = join_ranks(launch)
    bundle = _load(settings, ranks)
    engine = new_engine(bundle, settings, scheduler_factory=functools.partial(FollowerScheduler, ranks=ranks),
                        warm_up=False)
    engine.scheduler.bind(engine)
    ranks.barrier()
    logger.info("AR rank %d following rank 0", launch.rank)
    try:
        while True:
            engine.step()
    except _StopFollowing:
        logger.info("AR rank %d: rank 0 stopped", launch.rank)


class TensorParallelAR:
    """Rank 0's handle on the AR's ranks (`stage_ar.server.serve` drives it).

    Order: `start` (main thread) -> `join` -> `load` -> build the engine with `scheduler_factory`
    -> `ready(engine)` -> serve -> `stop(engine)` after the engine stopped.
    """

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.ranks: JoinedRanks | None = None
        self._stopping = threading.Event()

    @classmethod
    def start(cls, settings: Any) -> TensorParallelAR:
        """Spawn ranks ``1..tensor_parallel_size-1`` (call from the main thread).

        Raises:
            ValueError: the size does not divide the checkpoint's heads or MLP width (checked from
                its ``config.json`` before any process starts).
            mammoth_core.checkpoint.CheckpointError: no such checkpoint.
        """
        from mammoth_core.checkpoint import Checkpoint, resolve_checkpoint
        from stage_ar.configuration_mammoth_ar import MammothARConfig
        from stage_ar.tensor_parallel import check_tensor_parallel_size

        ckpt = Checkpoint(resolve_checkpoint(settings.checkpoint, settings.cache_dir))
        check_tensor_parallel_size(MammothARConfig.from_dict(ckpt.llm_config), settings.tensor_parallel_size)
        group = RankGroup.spawn(
            "ar", settings.tensor_parallel_size, settings.resolved_device(), run_worker, settings,
            timeout_s=settings.distributed_timeout_seconds,
            startup_timeout_s=settings.distributed_startup_timeout_seconds, log_format=settings.log_format,
            log_level=settings.log_level)
        return cls(group)

    def join(self) -> None:
        """Join as rank 0 (blocking)."""
        self.ranks = self.group.join()

    def load(self, settings: Any) -> Any:
        """Rank 0's `ARBundle` (its shard on ``cuda:0`` or the CPU)."""
        return _load(settings, self.ranks)

    @property
    def scheduler_factory(self) -> Callable[..., ARScheduler]:
        """Rank 0's `BroadcastingScheduler` for `DecodeEngine`."""
        return functools.partial(BroadcastingScheduler, ranks=self.ranks)

    def ready(self, engine: Any) -> None:
        """Once the engine exists: wait for every rank to have loaded, then watch the engine's turns."""
        engine.scheduler.bind(engine)
        self.ranks.barrier()
        threading.Thread(target=self._watchdog, args=(engine,), name="ar-rank-watchdog", daemon=True).start()

    def _watchdog(self, engine: Any) -> None:
        """Fail the stage when rank 0's engine, once ready, makes no turn for the collective timeout.

        Needed for the all-reduces captured in CUDA graphs: a replayed graph is not tracked by NCCL's
        watchdog, so a hung rank would stall rank 0's next readback forever; an idle engine turns
        every 50 ms, a turn is one decode step."""
        limit = self.group.launches[0].timeout_s
        while not self._stopping.wait(min(1.0, limit / 4)):
            stalled = time.monotonic() - engine.scheduler.last_turn
            if engine.ready.is_set() and stalled > limit:
                self.group.fail(f"rank 0's decode loop made no turn for {stalled:.0f} s (a rank stopped "
                                "answering collectives)")

    def stop(self, engine: Any) -> None:
        """After ``engine.stop()``: tell the workers to stop (unless the engine thread is stuck), then
        wait for them."""
        self._stopping.set()
        if not engine._thread.is_alive():  # noqa: SLF001 - a stuck engine thread owns the group
            try:
                engine.scheduler.send(TurnPlan(stop=True))
            except Exception:  # noqa: BLE001 - the workers are killed below anyway
                logger.exception("telling the AR ranks to stop failed")
        self.group.close()
