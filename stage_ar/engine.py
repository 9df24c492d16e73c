"""The AR decode engine: one dedicated thread runs every sequence, off the asyncio event loop.

Structure (DESIGN.md, "AR decode engine"): gRPC I/O runs on asyncio; decoding runs here, in its own
thread, and never waits on the network. Each turn of the loop is

    schedule (`ARScheduler`: reap aborted, admit waiting into KV slots)
    -> prefill the admitted (`T2ISequence.prefill` into their pool slots) and let them join
    -> run one batched decode step (`ARModelRunner.launch`, asynchronous on CUDA)
    -> read the previous step back (`ARModelRunner.collect`, one step late) and update each sequence
    -> emit typed outputs (`RowsReady`, `SequenceDone`) to each request's `RowSink`.

The sink's ``put_rows`` never blocks. A request leaves the batch as soon as its last grid token
is fed, or when it is aborted; its slots are reused by the next admission.

Admission is bounded by ``max_running_sequences`` (the KV pool holds twice that many slots, enough
for every request to use AR-side CFG): `DecodeEngine.submit` raises `EngineFull` instead of
queueing, and the caller answers ``RESOURCE_EXHAUSTED`` so the gateway can try another replica. A
cancelled job stops counting at once (`DecodeJob.cancel`), before the engine thread reaps it.

Its inputs and outputs (`DecodeJob`, `RowSink`, `RowsReady`, `SequenceDone`, `Role`, ...) live in
`stage_ar.engine_io` and are re-exported here. Roles are our own `Role`; the transport's proto
roles are the server's business.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Any, Callable

import torch

from stage_ar import gemv
from stage_ar.engine_io import (  # noqa: F401 - re-exported: the engine's public interface
    CollectingSink, DecodeJob, EngineOutput, JobStats, Role, RowSink, RowsReady, SequenceDone,
)
from stage_ar.generation import T2ISequence, cache_rows, grid_tokens
from stage_ar.runner import ARModelRunner, PendingStep
from stage_ar.scheduler import (
    ARScheduler,
    EngineCancelled,
    EngineDeadlineExceeded,
    EngineFull,
    EngineStopped,
    SchedulerRequest,
)

__all__ = [
    "CollectingSink", "DecodeEngine", "DecodeJob", "EngineCancelled", "EngineDeadlineExceeded", "EngineFull",
    "EngineStopped", "JobStats", "Role", "RowSink", "RowsReady", "SequenceDone",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Running:
    """Engine-side state of one admitted job (the scheduler request's payload)."""

    job: DecodeJob
    request: SchedulerRequest
    stats: JobStats
    seq: T2ISequence | None = None
    started: float = 0.0
    last_progress: float = 0.0
    slot: int | None = None  # first pool slot while in the runner's batch
    closed: bool = False
    cancel_callback: Callable[[], None] | None = None  # on ``job.cancel_callbacks`` while admitted


DEFAULT_MAX_SEQUENCE_LENGTH = 4608  # 1024x1024 (64*65 = 4160 grid tokens) + a 448-token prompt


class DecodeEngine:
    """Runs `DecodeJob`s in one background thread (or inline, `run_until_idle`).

    Args:
        make_sequence: builds a `T2ISequence` for a job (model, sampler, device already bound).
        max_running_sequences: admission bound (requests prefilled or decoding at once).
        progress_interval_s: minimum seconds between progress callbacks of one job (the last step
            always reports).
        model: the AR model the runner steps.
        grid_ids: ``(eol_token_id, visual_token_start_id, visual_token_end_id)``.
        max_sequence_length: positions per KV-pool slot (prompt + grid of the largest request);
            capped by the model's ``max_position_embeddings``. A longer request fails with ValueError.
        batch_invariant: run every batched step at the largest bucket (one GEMM shape), so a
            request's rows and tokens do not depend on what else is decoding (issue 8); the GEMV
            launches then compute only the live slots' bucket of rows (the runner's
            ``trim_gemv_rows``, which keeps a row's bits).
        decoder_options: extra keyword arguments for `ARModelRunner` (``exact_rows``,
            ``cuda_graphs``, ``buckets``, ``pad_to_max_bucket``, ``trim_gemv_rows``, ...), over
            the defaults above.
        kv_slots: KV-pool slots (default ``2 * max_running_sequences``: room for AR-side CFG on
            every request).
        warm_up: decode `stage_ar.warmup.warmup_jobs` before `ready` (default: on CUDA; skipped if jobs
            wait at the first step): ``warmup_s``, ``warmup_jobs``; step counters restart after it.
        scheduler_factory: builds the scheduler from ``(num_slots, slot_capacity,
            max_running_sequences)``; the tensor-parallel ranks pass theirs
            (`stage_ar.tensor_parallel_stage`: rank 0 broadcasts each turn's decisions, the others follow).
        on_failure: called once, from the decode thread, with the exception when the loop itself
            fails (a fault outside any one request's prefill or step, e.g. a CUDA error surfacing at
            a step's read-back): by then every admitted job has been failed with `EngineStopped`
            naming it, its sink aborted, and `submit` refuses new jobs; `ready` is set if it was
            not (a failed capture or warm-up). The server turns its health NOT_SERVING for good.

    Attributes:
        failure: the exception that stopped the decode loop, or None.
    """

    def __init__(
        self,
        make_sequence: Callable[[DecodeJob], T2ISequence],
        max_running_sequences: int,
        progress_interval_s: float = 0.05,
        *,
        model: Any,
        grid_ids: tuple[int, int, int],
        max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
        batch_invariant: bool = True,
        decoder_options: dict[str, Any] | None = None,
        kv_slots: int | None = None,
        warm_up: bool | None = None,
        scheduler_factory: Callable[..., ARScheduler] = ARScheduler,
        on_failure: Callable[[BaseException], None] | None = None,
    ):
        self._make_sequence = make_sequence
        self.max_running_sequences = max_running_sequences
        self._progress_interval = progress_interval_s
        self._max_len = min(max_sequence_length, int(model.config.max_position_embeddings))
        options = {"pad_to_max_bucket": batch_invariant, "trim_gemv_rows": batch_invariant, **(decoder_options or {})}
        self.runner = ARModelRunner(
            model, kv_slots or 2 * max_running_sequences, self._max_len,
            eol_token_id=grid_ids[0], visual_token_start_id=grid_ids[1], visual_token_end_id=grid_ids[2], **options,
        )
        self.scheduler = scheduler_factory(self.runner.num_slots, self._max_len, max_running_sequences)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ar-decode", daemon=True)
        self._pending: PendingStep | None = None
        self._runs: dict[DecodeJob, _Running] = {}  # by job (identity); touched by the engine thread
        self.steps_total = 0
        self.ready = threading.Event()
        self.failure: BaseException | None = None
        self.on_failure = on_failure
        self._warm_up = self.runner.on_cuda if warm_up is None else bool(warm_up)
        self.warmup_s: float | None = None  # seconds, and jobs finished, of the warm-up
        self.warmup_jobs, self._prepared = 0, False

    # -- control (any thread) -----------------------------------------------------------------

    @property
    def decoder(self) -> ARModelRunner:
        """The model runner (KV pool, CUDA graphs)."""
        return self.runner

    def start(self) -> None:
        """Start the decode thread (it captures the CUDA graphs first; see `ready`)."""
        self._thread.start()

    def stop_accepting(self) -> None:
        """Drain: refuse new jobs; running ones continue."""
        self.scheduler.stop_accepting()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread; running jobs are failed with `EngineStopped`."""
        self.scheduler.stop_accepting()
        self._stop.set()
        self._thread.join(timeout)

    @property
    def max_sequence_length(self) -> int:
        """Positions one request may use (prompt + grid); longer requests are refused."""
        return self._max_len

    @property
    def running(self) -> int:
        """Jobs admitted and neither finished nor cancelled."""
        return self.scheduler.num_admitted

    def submit(self, job: DecodeJob) -> None:
        """Admit ``job``.

        Raises:
            EngineFull: ``max_running_sequences`` jobs are already admitted.
            EngineStopped: the engine is draining or stopped.
            ValueError: the job needs more positions than a KV slot holds.
        """
        request = SchedulerRequest(
            job.request_id, cache_rows(job.ar_guidance_scale),
            len(job.prompt_ids) + grid_tokens(job.ar_width, job.ar_height), job.deadline,
        )
        run = _Running(job, request, JobStats(prompt_tokens=len(job.prompt_ids)))
        request.payload = run
        self._runs[job] = run  # before the engine thread can see the request
        try:
            self.scheduler.add(request)
        except Exception:
            self._runs.pop(job, None)
            raise
        # removed again in `_finish`: a finished job its caller keeps must not keep the engine (its
        # KV pool and graphs) alive through this closure
        run.cancel_callback = lambda: self.scheduler.abort(request)
        job.cancel_callbacks.append(run.cancel_callback)
        if job.cancelled.is_set():
            self.scheduler.abort(request)

    # -- engine thread ------------------------------------------------------------------------

    def _prepare(self) -> None:
        """Once: capture the runner's CUDA graphs (no-op on CPU; decoding continues without graphs if
        capture fails), then the warm-up when on and no job is waiting yet, then set `ready`."""
        if self._prepared:
            return
        self._prepared = True  # the warm-up's own steps come back here
        t0 = time.perf_counter()
        try:
            self.runner.capture()
        except Exception:  # noqa: BLE001 - keep serving, slower
            logger.exception("capturing CUDA graphs failed; decoding without graphs")
            self.runner.cuda_graphs = False
        if self._warm_up and not self.scheduler.num_admitted:
            from stage_ar.warmup import run_warmup  # it builds this module's jobs

            self.warmup_s, self.warmup_jobs = run_warmup(self)
            self.steps_total = self.runner.steps_launched = 0
        r = self.runner
        logger.info("AR runner: %d slots x %d positions (%.2f GiB KV), exact_rows=%s, cuda_graphs=%s, "
                    "warm-up %s s (%.1f s in all)", r.num_slots, r.capacity, r.pool.nbytes / 2**30, r.exact_rows,
                    r.cuda_graphs, None if self.warmup_s is None else round(self.warmup_s, 2), time.perf_counter() - t0)
        picks = gemv.tuned_picks()
        if picks:  # what this process's GEMVs run with: the makings of a picks file (`stage_ar.gemv.pinned_picks`)
            logger.info("GEMV picks (%d variants; %d pinned from a picks file): %s", len(picks),
                        len(gemv.pinned_picks(self.runner.device)), json.dumps(picks, separators=(",", ":")))
        self.ready.set()

    def _loop(self) -> None:
        reason = EngineStopped("AR engine stopped")
        try:
            self._prepare()
            while not self._stop.is_set():
                if not self.runner.active_count and self._pending is None:
                    self.scheduler.wait_for_work(0.05)
                self.step()
            self._flush()
        except BaseException as exc:  # noqa: BLE001 - the loop's own fault: fail its jobs, never strand them
            logger.exception("AR decode loop failed; failing its %d request(s) and refusing new ones",
                             self.scheduler.num_admitted)
            self.failure, self._pending = exc, None
            reason = EngineStopped(f"the AR engine failed ({type(exc).__name__}: {exc}); it takes no new work")
        for request in self.scheduler.drain_all(reason):
            self._emit([SequenceDone(request.payload.job, request.abort_reason)])
        if self.failure is not None:
            self.ready.set()  # a server waiting for readiness sees `failure` instead of waiting forever
            if self.on_failure is not None:
                try:
                    self.on_failure(self.failure)
                except Exception:  # noqa: BLE001 - the jobs are already failed
                    logger.exception("AR engine on_failure callback failed")

    def run_until_idle(self) -> None:
        """Run the loop in the calling thread until no job is left (in-process runs, benchmarks)."""
        self._prepare()
        self.step_until_idle()

    def step_until_idle(self) -> None:
        """`step` in the calling thread until no job is left (no graph capture, no warm-up)."""
        while self.scheduler.num_admitted or self.runner.active_count or self._pending is not None:
            self.step()
        self._flush()

    def run_job(self, job: DecodeJob) -> None:
        """Submit ``job`` and run the loop in the calling thread until it is done (the engine must
        not be `start`ed). Raises the job's error, if any."""
        errors: list[BaseException | None] = []
        on_done = job.on_done
        job.on_done = lambda exc, stats: (errors.append(exc), on_done(exc, stats))
        self.submit(job)
        self.run_until_idle()
        if errors and errors[0] is not None:
            raise errors[0]

    def step(self) -> None:
        """One turn: schedule -> prefill joins -> launch a step -> collect the previous -> emit.

        The first turn captures the runner's CUDA graphs before anything is admitted (`_prepare`),
        so driving the engine inline (`step`, `run_until_idle`) and by its thread behave the same."""
        self._prepare()
        out = self.scheduler.schedule()
        for request in out.aborted:
            self._emit(self._leave(request.payload, request.abort_reason))
        for request in out.admitted:
            self._emit(self._prefill(request.payload))
        launched = None
        if self.runner.active_count:
            try:
                launched = self.runner.launch()
            except Exception as exc:  # noqa: BLE001 - a broken step fails its requests
                logger.exception("batched decode step failed")
                for request in self.scheduler.running:
                    self._emit(self._leave(request.payload, exc))
        windows = self._speculate()
        self._flush()
        self._pending = launched
        self._emit(windows)

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._emit(self._collect(pending))

    @torch.inference_mode()
    def _prefill(self, run: _Running) -> list[EngineOutput]:
        job, first = run.job, run.request.first_slot
        t0 = run.started = time.perf_counter()
        try:
            run.seq = seq = self._make_sequence(job)
            seq.attach_kv_cache(self.runner.kv_view(first, seq.cache_batch))
            rows = seq.prefill()
            out: list[EngineOutput] = [RowsReady(job, Role.CONDITION, rows.hidden, list(rows.token_ids))]
            if job.negative_ids:
                neg = seq.negative_rows()
                out.append(RowsReady(job, Role.NEGATIVE, neg.hidden, list(neg.token_ids)))
            self.runner.activate(run, seq, first)
        except Exception as exc:  # noqa: BLE001 - reported to the request, engine continues
            logger.exception("prefill failed for %s", job.request_id)
            return [SequenceDone(job, exc)]
        run.slot = first
        run.stats.prefill_ms = (time.perf_counter() - t0) * 1e3
        run.last_progress = time.perf_counter()
        job.on_progress(0, seq.grid_tokens)
        return out

    def _collect(self, pending: PendingStep) -> list[EngineOutput]:
        """Read a launched step's ids back (the one host sync per step); one row per entry."""
        fed, sampled = self.runner.collect(pending)
        return [out for e in pending.entries if not e.key.closed  # else aborted after the launch
                for out in self._final_tokens(e.key, e.finished, [fed[e.slot]], [sampled[e.slot]],
                                              pending.hidden[e.slot : e.slot + 1])]

    def _speculate(self) -> list[EngineOutput]:
        """One Jacobi turn (`ARModelRunner.speculate`): each window's final tokens as rows."""
        try:
            results = self.runner.speculate()
        except Exception as exc:  # noqa: BLE001 - a broken verification fails its requests
            logger.exception("Jacobi verification step failed")
            runs = [r.payload for r in self.scheduler.running if r.payload.seq and r.payload.seq.decoding.jacobi]
            return [out for run in runs for out in self._leave(run, exc)]
        return [out for r in results if not r.key.closed
                for out in self._final_tokens(r.key, r.finished, r.fed, r.fed[1:] + [r.next_token], r.hidden)]

    def _final_tokens(self, run: _Running, left: bool, fed: list[int], sampled: list[int],
                      hidden: torch.Tensor) -> list[EngineOutput]:
        """``fed`` tokens final (``sampled[i]`` drawn after ``fed[i]``, rows ``hidden``); ``left``: out of the batch."""
        run.slot = None if left else run.slot
        try:
            for token, sample in zip(fed, sampled):
                run.seq.record_external_step(token, sample)
        except Exception as exc:  # noqa: BLE001 - fails this job only
            logger.exception("decode step bookkeeping failed for %s", run.job.request_id)
            return [SequenceDone(run.job, exc)]
        out: list[EngineOutput] = [RowsReady(run.job, Role.CONDITION, hidden, list(fed))]
        if run.seq.finished:
            out.append(SequenceDone(run.job, None))
        return out

    def _leave(self, run: _Running, error: BaseException | None) -> list[EngineOutput]:
        """Take ``run`` out of the batch and free its cache; the scheduler frees the slots."""
        if run.slot is not None:
            self.runner.deactivate(run.slot, key=run)
            run.slot = None
        return [SequenceDone(run.job, error)]

    def _emit(self, outputs: list[EngineOutput]) -> None:
        """Hand outputs to the jobs' sinks; a failing sink fails only its own job."""
        for output in outputs:
            run = self._runs.get(output.job)
            if run is None or run.closed:
                continue
            try:
                if isinstance(output, RowsReady):
                    self._deliver_rows(run, output)
                else:
                    self._finish(run, output.error)
            except Exception as exc:  # noqa: BLE001
                logger.exception("emitting to %s failed", output.job.request_id)
                self._finish(run, exc)

    def _deliver_rows(self, run: _Running, rows: RowsReady) -> None:
        run.job.sink.put_rows(rows.role, rows.hidden, rows.token_ids)
        if rows.role is not Role.CONDITION:
            return
        run.stats.rows_sent += len(rows.token_ids)
        if run.job.row_times is not None:
            run.job.row_times.append((run.stats.rows_sent, time.time() * 1e3))
        if len(rows.token_ids) == 1:
            self.steps_total += 1
        now = time.perf_counter()
        seq = run.seq
        if seq.finished or now - run.last_progress >= self._progress_interval:
            run.last_progress = now
            run.job.on_progress(run.stats.rows_sent - run.stats.prompt_tokens, seq.grid_tokens)

    def _finish(self, run: _Running, error: BaseException | None) -> None:
        """On success record the outcome (``on_done``) and only then finish the sink; on failure
        abort the sink, then report."""
        if run.closed:
            return
        run.closed = True
        self._runs.pop(run.job, None)
        if run.cancel_callback is not None:
            try:
                run.job.cancel_callbacks.remove(run.cancel_callback)
            except ValueError:  # the caller cleared the list
                pass
            run.cancel_callback = None
        try:  # device bookkeeping; after a device fault it may raise again: the caller must still hear
            self._leave(run, error)
        except Exception:  # noqa: BLE001
            logger.exception("freeing %s's batch slot failed", run.job.request_id)
            run.slot = None
        self.scheduler.finish(run.request)
        if run.seq is not None:
            try:
                run.seq.release()  # frees the KV cache now, whatever happens to the request
            except Exception:  # noqa: BLE001
                logger.exception("releasing %s's KV cache failed", run.job.request_id)
        stats = run.stats
        if error is None:
            now = time.perf_counter()
            stats.generated_tokens = stats.rows_sent - stats.prompt_tokens
            stats.decode_ms = (now - run.started) * 1e3 - stats.prefill_ms
            stats.last_row_unix_ms = time.time() * 1e3
        if error is None:
            # Decoding is recorded as done BEFORE the push is finished: once the sink sends its last
            # chunk the DiT may acknowledge the stream at once, and an acknowledgement that arrives
            # before "done" reads as a DiT that closed the stream early (issue 15.1).
            try:
                run.job.on_done(None, stats)
            finally:
                run.job.sink.finish()
        else:
            try:
                run.job.sink.abort()
            finally:
                run.job.on_done(error, stats)
