"""The AR decode engine: one dedicated thread runs every sequence, off the asyncio event loop.

Structure (DESIGN.md, "Request path"): gRPC I/O runs on asyncio; decoding runs here, in its own
thread, and never waits on the network. Requests join and leave between decode steps. After every
step the new hidden-state row is handed to the request's `RowSink` (the hidden-state sender), whose
``put_rows`` never blocks: a slow or absent consumer cannot stall the loop for other requests.

This is the simple, correct engine: each running sequence advances one token per engine iteration
with its own KV cache (round-robin). Admission is bounded by ``max_running_sequences`` (the KV-cache
budget): `DecodeEngine.submit` raises `EngineFull` instead of queueing, and the caller answers
``RESOURCE_EXHAUSTED`` so the gateway can try another replica.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable, Protocol

import torch

from mammoth_core.pb import mammoth_pb2 as pb

logger = logging.getLogger(__name__)


class EngineFull(RuntimeError):
    """No room for another running sequence (``max_running_sequences`` reached)."""


class EngineStopped(RuntimeError):
    """The engine is draining or stopped and accepts no new sequence."""


class RowSink(Protocol):
    """Where a sequence's hidden-state rows go (the hidden-state sender). Thread-safe, non-blocking."""

    def put_rows(self, role: int, hidden: torch.Tensor, token_ids: list[int]) -> None: ...

    def finish(self) -> None: ...

    def abort(self) -> None: ...


@dataclasses.dataclass
class DecodeJob:
    """One request for the engine.

    Attributes:
        request_id, epoch: identity of the request attempt.
        prompt_ids: the text-to-image envelope token ids.
        negative_ids: negative prompt ids (prefilled as a second sequence) or None.
        ar_width, ar_height: grid size in tokens (pixels // 16).
        seed: sampling seed.
        temperature, top_k, top_p: sampling overrides (0: checkpoint defaults).
        ar_guidance_scale: AR-side CFG scale (<= 1: off).
        sink: receives rows (`RowSink`).
        on_progress: called from the engine thread with (tokens_sampled, total_samples).
        on_done: called from the engine thread once, with None on success or the exception.
    """

    request_id: str
    epoch: int
    prompt_ids: list[int]
    negative_ids: list[int] | None
    ar_width: int
    ar_height: int
    seed: int
    temperature: float
    top_k: int
    top_p: float
    ar_guidance_scale: float
    sink: RowSink
    on_progress: Callable[[int, int], None]
    on_done: Callable[[BaseException | None, "JobStats"], None]
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    #: When a list, the engine appends ``(CONDITION rows produced so far, unix ms)`` after every
    #: hand-off to the sink (request traces; see the ``trace_dir`` setting).
    row_times: list[tuple[int, float]] | None = None

    def cancel(self) -> None:
        """Ask the engine to drop this sequence before its next step (thread-safe)."""
        self.cancelled.set()


@dataclasses.dataclass
class JobStats:
    """Timings and counts of one finished (or failed) job; times in ms, counts in tokens/rows."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    rows_sent: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    last_row_unix_ms: float = 0.0


class SequenceFactory(Protocol):
    """Builds the per-request state machine (`stage_ar.generation.T2ISequence`)."""

    def __call__(self, job: DecodeJob) -> Any: ...


@dataclasses.dataclass
class _Running:
    job: DecodeJob
    seq: Any
    stats: JobStats
    started: float
    last_progress: float = 0.0


class DecodeEngine:
    """Runs `DecodeJob`s in one background thread.

    Args:
        make_sequence: builds a `T2ISequence` for a job (model, sampler, device already bound).
        max_running_sequences: admission bound (KV caches alive at once).
        progress_interval_s: minimum seconds between progress callbacks of one job (the last step
            always reports).
    """

    def __init__(
        self,
        make_sequence: SequenceFactory,
        max_running_sequences: int,
        progress_interval_s: float = 0.05,
    ):
        self._make_sequence = make_sequence
        self.max_running_sequences = max_running_sequences
        self._progress_interval = progress_interval_s
        self._inbox: "queue.Queue[DecodeJob]" = queue.Queue()
        self._lock = threading.Lock()
        self._admitted = 0
        self._accepting = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ar-decode", daemon=True)
        self.steps_total = 0

    # -- control (any thread) -----------------------------------------------------------------

    def start(self) -> None:
        """Start the decode thread."""
        self._thread.start()

    def stop_accepting(self) -> None:
        """Drain: refuse new jobs; running ones continue."""
        self._accepting = False

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread; running jobs are failed with `EngineStopped`."""
        self._accepting = False
        self._stop.set()
        self._thread.join(timeout)

    @property
    def running(self) -> int:
        """Jobs admitted and not finished (queued for prefill or decoding)."""
        with self._lock:
            return self._admitted

    def submit(self, job: DecodeJob) -> None:
        """Admit ``job``.

        Raises:
            EngineFull: ``max_running_sequences`` jobs are already admitted.
            EngineStopped: the engine is draining or stopped.
        """
        if not self._accepting:
            raise EngineStopped("AR engine is draining")
        with self._lock:
            if self._admitted >= self.max_running_sequences:
                raise EngineFull(
                    f"AR has {self._admitted} running sequences (max_running_sequences="
                    f"{self.max_running_sequences})"
                )
            self._admitted += 1
        self._inbox.put(job)

    # -- engine thread ------------------------------------------------------------------------

    def _release(self, run: _Running, exc: BaseException | None) -> None:
        with self._lock:
            self._admitted -= 1
        if run.seq is not None:
            run.seq.release()  # frees the KV cache now, whatever happens to the request
        try:
            if exc is None:
                run.job.sink.finish()
            else:
                run.job.sink.abort()
        finally:
            run.job.on_done(exc, run.stats)

    def _admit_new(self, running: list[_Running]) -> None:
        block = not running
        while True:
            try:
                job = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            stats = JobStats(prompt_tokens=len(job.prompt_ids))
            run = _Running(job=job, seq=None, stats=stats, started=time.perf_counter())
            if job.cancelled.is_set():
                self._release(run, EngineCancelled(job.request_id))
                continue
            try:
                self._prefill(run)
            except Exception as exc:  # noqa: BLE001 - reported to the request, engine continues
                logger.exception("prefill failed for %s", job.request_id)
                self._release(run, exc)
                continue
            running.append(run)

    @torch.inference_mode()
    def _prefill(self, run: _Running) -> None:
        job = run.job
        t0 = time.perf_counter()
        run.seq = self._make_sequence(job)
        rows = run.seq.prefill()
        job.sink.put_rows(pb.CONDITION, rows.hidden, _ids(rows.token_ids))
        run.stats.rows_sent += int(rows.hidden.shape[0])
        if job.row_times is not None:
            job.row_times.append((run.stats.rows_sent, time.time() * 1e3))
        if job.negative_ids:
            neg = run.seq.negative_rows()
            job.sink.put_rows(pb.NEGATIVE, neg.hidden, _ids(neg.token_ids))
        run.stats.prefill_ms = (time.perf_counter() - t0) * 1e3
        run.last_progress = time.perf_counter()
        job.on_progress(run.seq.tokens_sampled, run.seq.total_samples)

    @torch.inference_mode()
    def _step(self, run: _Running) -> bool:
        """One decode step for ``run``; True when the sequence finished."""
        rows = run.seq.step()
        run.job.sink.put_rows(pb.CONDITION, rows.hidden, _ids(rows.token_ids))
        run.stats.rows_sent += int(rows.hidden.shape[0])
        if run.job.row_times is not None:
            run.job.row_times.append((run.stats.rows_sent, time.time() * 1e3))
        self.steps_total += 1
        now = time.perf_counter()
        finished = bool(run.seq.finished)
        if finished or now - run.last_progress >= self._progress_interval:
            run.last_progress = now
            run.job.on_progress(run.seq.tokens_sampled, run.seq.total_samples)
        if finished:
            run.stats.generated_tokens = run.stats.rows_sent - run.stats.prompt_tokens
            run.stats.decode_ms = (now - run.started) * 1e3 - run.stats.prefill_ms
            run.stats.last_row_unix_ms = time.time() * 1e3
        return finished

    def _loop(self) -> None:
        running: list[_Running] = []
        while not self._stop.is_set():
            self._admit_new(running)
            still: list[_Running] = []
            for run in running:
                if run.job.cancelled.is_set():
                    self._release(run, EngineCancelled(run.job.request_id))
                    continue
                try:
                    done = self._step(run)
                except Exception as exc:  # noqa: BLE001
                    logger.exception("decode step failed for %s", run.job.request_id)
                    self._release(run, exc)
                    continue
                if done:
                    self._release(run, None)
                else:
                    still.append(run)
            running = still
        for run in running:
            self._release(run, EngineStopped("AR engine stopped"))
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                break
            self._release(_Running(job, None, JobStats(), time.perf_counter()), EngineStopped("AR engine stopped"))


class EngineCancelled(RuntimeError):
    """The request was cancelled (client gone, deadline, or its push failed)."""


def _ids(token_ids: Any) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        return [int(x) for x in token_ids.reshape(-1).tolist()]
    return [int(x) for x in token_ids]
