"""The AR decode engine: one dedicated thread runs every sequence, off the asyncio event loop.

Structure (DESIGN.md, "Request path"): gRPC I/O runs on asyncio; decoding runs here, in its own
thread, and never waits on the network. Requests join and leave between decode steps (continuous
batching): a new request is prefilled on its own (`T2ISequence.prefill`, writing its keys/values
straight into a slot of the shared `KVPool`) and then joins the next batched step of
`stage_ar.batch_engine.BatchedDecoder`, which advances every running request by one token in one
forward with fused on-device grid-constrained sampling (CUDA graphs per batch bucket on CUDA). A
request leaves the batch as soon as its last grid token is fed, or when it is cancelled; its slots
are reused by the next join.

After every step each request's new hidden-state row is handed to its `RowSink` (the hidden-state
sender), whose ``put_rows`` never blocks. The step's ids are read back one step late (the host
launches step t+1 before waiting for step t's ids), so the device never idles on the host.

Admission is bounded by ``max_running_sequences`` (the KV pool holds twice that many slots, enough
for every request to use AR-side CFG): `DecodeEngine.submit` raises `EngineFull` instead of
queueing, and the caller answers ``RESOURCE_EXHAUSTED`` so the gateway can try another replica.

If the batched decoder cannot serve the model (grid ids that are not generation ids), every
sequence is stepped on its own with `T2ISequence.step` (the B=1 path).
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
from stage_ar.batch_engine import BatchedDecoder, PendingStep

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
        on_progress: called from the engine thread with (image tokens decoded, image tokens in all):
            rows emitted after the prompt, of ``h * (w + 1)``, the count ``usage`` reports (the
            look-ahead sample, never fed, is not counted).
        on_done: called from the engine thread once, with None on success or the exception; on
            success before ``sink.finish()``, so "decoding done" is known before the push can be
            acknowledged.
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


@dataclasses.dataclass(eq=False)
class _Running:
    job: DecodeJob
    seq: Any
    stats: JobStats
    started: float
    last_progress: float = 0.0
    slot: int | None = None  # first pool slot while in the batched decoder
    closed: bool = False


DEFAULT_MAX_SEQUENCE_LENGTH = 4608  # 1024x1024 (64*65 = 4160 grid tokens) + a 448-token prompt


class DecodeEngine:
    """Runs `DecodeJob`s in one background thread.

    Args:
        make_sequence: builds a `T2ISequence` for a job (model, sampler, device already bound).
        max_running_sequences: admission bound (requests prefilled or decoding at once).
        progress_interval_s: minimum seconds between progress callbacks of one job (the last step
            always reports).
        model: the AR model; with ``grid_ids`` the batched decoder (and its CUDA graphs) is built when
            the thread starts, otherwise at the first job from that job's sequence.
        grid_ids: ``(eol_token_id, visual_token_start_id, visual_token_end_id)``.
        max_sequence_length: positions per KV-pool slot (prompt + grid of the largest request);
            capped by the model's ``max_position_embeddings``. A longer request fails with ValueError.
        batched: use the batched decoder (default True; False = `T2ISequence.step` per request).
        batch_invariant: run every batched step at the largest bucket (one GEMM shape), so a
            request's rows and tokens do not depend on what else is decoding (issue 8); costs the
            padded rows' attention (docs/PERFORMANCE.md). False: smallest bucket that fits.
        decoder_options: extra keyword arguments for `BatchedDecoder` (``exact_rows``,
            ``cuda_graphs``, ``buckets``, ``pad_to_max_bucket``).
    """

    def __init__(
        self,
        make_sequence: SequenceFactory,
        max_running_sequences: int,
        progress_interval_s: float = 0.05,
        *,
        model: Any = None,
        grid_ids: tuple[int, int, int] | None = None,
        max_sequence_length: int = DEFAULT_MAX_SEQUENCE_LENGTH,
        batched: bool = True,
        batch_invariant: bool = True,
        decoder_options: dict[str, Any] | None = None,
    ):
        self._make_sequence = make_sequence
        self.max_running_sequences = max_running_sequences
        self._progress_interval = progress_interval_s
        self._model = model
        self._grid_ids = grid_ids
        self._max_len = max_sequence_length
        self._batched = batched
        self._decoder_options = dict(decoder_options or {})
        self._decoder_options.setdefault("pad_to_max_bucket", batch_invariant)
        self.decoder: BatchedDecoder | None = None
        self._inbox: "queue.Queue[DecodeJob]" = queue.Queue()
        self._lock = threading.Lock()
        #: Admitted jobs not yet released, by id; a cancelled one stops counting at once (issue 15.7).
        self._admitted: dict[int, DecodeJob] = {}
        self._accepting = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ar-decode", daemon=True)
        self.steps_total = 0
        self.ready = threading.Event()

    # -- control (any thread) -----------------------------------------------------------------

    def start(self) -> None:
        """Start the decode thread (it builds the decoder and captures graphs first; see `ready`)."""
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
    def max_sequence_length(self) -> int:
        """Positions one request may use (prompt + grid); longer requests are refused."""
        return self._max_len

    @property
    def running(self) -> int:
        """Jobs admitted and not finished (queued for prefill or decoding)."""
        with self._lock:
            return self._live()

    def _live(self) -> int:
        """Admitted jobs that still count against ``max_running_sequences`` (caller holds the lock):
        a cancelled job's admission is free the moment it is cancelled, before the engine thread
        reaps it (its KV slots are reaped before the next admission, see `_loop`)."""
        return sum(1 for job in self._admitted.values() if not job.cancelled.is_set())

    def submit(self, job: DecodeJob) -> None:
        """Admit ``job``.

        Raises:
            EngineFull: ``max_running_sequences`` jobs are already admitted.
            EngineStopped: the engine is draining or stopped.
        """
        if not self._accepting:
            raise EngineStopped("AR engine is draining")
        with self._lock:
            live = self._live()
            if live >= self.max_running_sequences:
                raise EngineFull(
                    f"AR has {live} running sequences (max_running_sequences={self.max_running_sequences})"
                )
            self._admitted[id(job)] = job
        self._inbox.put(job)

    # -- engine thread ------------------------------------------------------------------------

    def _build_decoder(self, model: Any, grid_ids: tuple[int, int, int]) -> None:
        if self.decoder is not None or not self._batched:
            return
        capacity = min(self._max_len, int(model.config.max_position_embeddings))
        try:
            self.decoder = BatchedDecoder(
                model,
                2 * self.max_running_sequences,
                capacity,
                eol_token_id=grid_ids[0],
                visual_token_start_id=grid_ids[1],
                visual_token_end_id=grid_ids[2],
                **self._decoder_options,
            )
        except ValueError as exc:
            logger.warning("batched decoder unavailable (%s); stepping each sequence alone", exc)
            self._batched = False
            return
        t0 = time.perf_counter()
        self.decoder.capture()
        logger.info(
            "batched decoder: %d slots x %d positions (%.2f GiB KV), exact_rows=%s, cuda_graphs=%s (%.1f s)",
            self.decoder.num_slots, self.decoder.capacity, self.decoder.pool.nbytes / 2**30,
            self.decoder.exact_rows, self.decoder.cuda_graphs, time.perf_counter() - t0,
        )

    def _release(self, run: _Running, exc: BaseException | None) -> None:
        if run.closed:
            return
        run.closed = True
        with self._lock:
            self._admitted.pop(id(run.job), None)
        if run.slot is not None and self.decoder is not None:
            self.decoder.deactivate(run.slot, key=run)  # no-op when it already left the batch
            run.slot = None
        if run.seq is not None:
            run.seq.release()  # frees the KV cache now, whatever happens to the request
        if exc is None:
            # Decoding is recorded as done BEFORE the push is finished: once the sink sends its last
            # chunk the DiT may acknowledge the stream at once, and an acknowledgement that arrives
            # before "done" reads as a DiT that closed the stream early (issue 15.1).
            try:
                run.job.on_done(None, run.stats)
            finally:
                run.job.sink.finish()
        else:
            try:
                run.job.sink.abort()
            finally:
                run.job.on_done(exc, run.stats)

    def _admit_new(self, running: list[_Running], block: bool) -> None:
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
        run.seq = seq = self._make_sequence(job)
        if self._batched:
            s = seq.sampler
            self._build_decoder(seq.model, (s.eol_token_id, s.visual_token_start_id, s.visual_token_end_id))
        first = self.decoder.reserve(seq) if self._batched else None
        try:
            rows = seq.prefill()
        except BaseException:
            if first is not None:
                self.decoder.unreserve(first, seq.cache_batch)
            raise
        job.sink.put_rows(pb.CONDITION, rows.hidden, _ids(rows.token_ids))
        run.stats.rows_sent += int(rows.hidden.shape[0])
        if job.row_times is not None:
            job.row_times.append((run.stats.rows_sent, time.time() * 1e3))
        if job.negative_ids:
            neg = seq.negative_rows()
            job.sink.put_rows(pb.NEGATIVE, neg.hidden, _ids(neg.token_ids))
        if first is not None:
            self.decoder.activate(run, seq, first)
            run.slot = first
        run.stats.prefill_ms = (time.perf_counter() - t0) * 1e3
        run.last_progress = time.perf_counter()
        job.on_progress(0, seq.grid_tokens)

    def _after_row(self, run: _Running, hidden: torch.Tensor, token: int) -> bool:
        """Hand one decoded row to the sink, report progress; True when the sequence finished."""
        run.job.sink.put_rows(pb.CONDITION, hidden, [int(token)])
        run.stats.rows_sent += 1
        if run.job.row_times is not None:
            run.job.row_times.append((run.stats.rows_sent, time.time() * 1e3))
        self.steps_total += 1
        now = time.perf_counter()
        finished = bool(run.seq.finished)
        if finished or now - run.last_progress >= self._progress_interval:
            run.last_progress = now
            run.job.on_progress(run.stats.rows_sent - run.stats.prompt_tokens, run.seq.grid_tokens)
        if finished:
            run.stats.generated_tokens = run.stats.rows_sent - run.stats.prompt_tokens
            run.stats.decode_ms = (now - run.started) * 1e3 - run.stats.prefill_ms
            run.stats.last_row_unix_ms = time.time() * 1e3
        return finished

    def _emit(self, pending: PendingStep) -> None:
        """Read a launched step's ids back (the one host sync per step) and emit its rows."""
        fed, sampled = self.decoder.collect(pending)
        for entry in pending.entries:
            run: _Running = entry.key
            if run.closed:
                continue  # cancelled after the launch
            if entry.finished:
                run.slot = None  # already out of the batch
            try:
                run.seq.record_external_step(fed[entry.slot], sampled[entry.slot])
                done = self._after_row(run, pending.hidden[entry.slot : entry.slot + 1], fed[entry.slot])
            except Exception as exc:  # noqa: BLE001
                logger.exception("emitting a row failed for %s", run.job.request_id)
                self._release(run, exc)
                continue
            if done:
                self._release(run, None)

    @torch.inference_mode()
    def _step_alone(self, run: _Running) -> bool:
        rows = run.seq.step()
        return self._after_row(run, rows.hidden, rows.token_ids[0])

    def _loop(self) -> None:
        if self._batched and self._model is not None and self._grid_ids is not None:
            try:
                self._build_decoder(self._model, self._grid_ids)
            except Exception:  # noqa: BLE001 - fall back to the B=1 path, keep serving
                logger.exception("building the batched decoder failed; stepping each sequence alone")
                self.decoder, self._batched = None, False
        self.ready.set()
        running: list[_Running] = []
        pending: PendingStep | None = None
        while not self._stop.is_set():
            # Cancelled sequences leave first: their admission is already free (`submit`), so their
            # KV slots must be back before a job admitted in their place is prefilled.
            for run in running:
                if run.job.cancelled.is_set():
                    self._release(run, EngineCancelled(run.job.request_id))
            running = [r for r in running if not r.closed]
            self._admit_new(running, block=not running and pending is None)
            launched = None
            if self.decoder is not None and self.decoder.active_count:
                try:
                    launched = self.decoder.launch()
                except Exception as exc:  # noqa: BLE001 - a broken step fails its requests
                    logger.exception("batched decode step failed")
                    for run in running:
                        if run.slot is not None:
                            self._release(run, exc)
            if pending is not None:
                self._emit(pending)
            pending = launched
            for run in running:
                if run.closed or run.slot is not None or run.seq is None or run.seq.finished:
                    continue
                try:  # no batched decoder: the B=1 path
                    if self._step_alone(run):
                        self._release(run, None)
                except Exception as exc:  # noqa: BLE001
                    logger.exception("decode step failed for %s", run.job.request_id)
                    self._release(run, exc)
            running = [r for r in running if not r.closed]
        if pending is not None:
            self._emit(pending)
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
