"""The DiT worker loop: one per device, continuous batching by step across requests.

`DiTEngine.submit` hands a job to the loop. The loop thread, between steps, admits waiting jobs
(up to ``max_batch_requests`` active; each job's conditions are prepared there, on the device's
thread), reaps cancelled ones, groups the active requests by resolution and runs one
`stage_dit.denoise.denoise_step` per group: one transformer forward over every CFG branch of every
request of that size. A finished request's latents go to a separate decode thread (VAE, previews
too), and its final image encoding (PNG/JPEG/WebP, CPU, the GIL released inside the codec) to a
small pool of encoder threads, so no request's decode sits on another request's step path and
images finishing at the same step encode side by side instead of one after another.

Isolation: each request owns its latents, scheduler, step index and cache (`DenoiseState`). A
group whose forward raises is re-run request by request, so only the request that fails alone
fails (its batch mates' results are unchanged: the batched forward equals the alone one, see
`stage_dit.denoise`). A job's sink (the consumer) raising cancels that job only.

Events, delivered to the job's sink from the engine's threads in order: `StepFinished` per step,
`PartialImage` per preview, then exactly one terminal event, `ImageFinished` or `RequestFailed`
(not sent for a cancelled job). `EngineJob.retired` resolves once the engine holds no reference to
the job's tensors (before its terminal event is delivered, or once a cancelled job was reaped).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from stage_dit import metrics
from stage_dit.denoise import DenoiseState, ImageRequest, denoise_step

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepFinished:
    """Step ``step`` (1-based) of ``total`` is done; ``skipped``: answered by the step cache."""

    step: int
    total: int
    skipped: bool = False


@dataclass(frozen=True)
class PartialImage:
    """Preview ``index`` (0-based): the latents after some step, decoded and encoded."""

    index: int
    data: bytes


@dataclass(frozen=True)
class ImageTimings:
    """Milliseconds: admission -> last step, VAE decode, encoding; steps the cache skipped."""

    denoise_ms: float
    vae_ms: float
    encode_ms: float
    steps_skipped: int = 0


@dataclass(frozen=True)
class ImageFinished:
    """The final output (``output_type``: encoded bytes, a `(3, H, W)` tensor or latents)."""

    output: object
    timings: ImageTimings


@dataclass(frozen=True)
class RequestFailed:
    """The job failed; ``error`` is what was raised (ValueError: the request was refused)."""

    error: BaseException


EngineEvent = StepFinished | PartialImage | ImageFinished | RequestFailed


@dataclass
class EngineJob:
    """One request in the engine (returned by `DiTEngine.submit`).

    Attributes:
        prepare: called once on the loop thread at admission; returns the `ImageRequest`
            (conditions prepared). Raising fails the job.
        sink: receives the `EngineEvent` s.
        output_type, compression: see `MammothDiTPipeline.postprocess`.
        previews: ``{step (1-based): preview index}``.
        request_id: for logs and profiles.
        retired: resolves (to None) once the engine dropped the job.
    """

    prepare: Callable[[], ImageRequest]
    sink: Callable[[EngineEvent], None]
    output_type: str = "png"
    compression: int = 0
    previews: dict[int, int] = field(default_factory=dict)
    retired: Future = field(default_factory=Future)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    state: DenoiseState | None = None
    admitted_at: float = 0.0
    step_skipped: bool = False
    request_id: str = ""
    profile: object = None

    def cancel(self) -> None:
        """Stop the job before its next step (thread-safe, idempotent); no terminal event follows."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class DiTEngine:
    """The worker loop and its decode thread over one `MammothDiTPipeline`.

    Args:
        pipeline: the loaded pipeline.
        max_batch_requests: most requests denoising at once (more wait to be admitted).
        idle_wait_s: how long the idle loop blocks waiting for a job.
        profiler: a `mammoth_core.profiling.StageProfiler`: an armed request's trace covers the loop
            from its admission to its last step (its batch mates' work included).
        encode_workers: threads encoding final images (>= 1).
        on_failure: called once, from the loop thread, with the exception when the loop itself
            fails (a fault outside any one request's step, e.g. a CUDA error surfacing at the next
            synchronisation): every waiting and active job has got `RequestFailed` by then and
            `submit` refuses new ones; the server turns its health NOT_SERVING so the pod is replaced.

    Attributes:
        failure: the exception that stopped the loop, or None.
    """

    def __init__(self, pipeline, max_batch_requests: int, idle_wait_s: float = 0.05, profiler=None,
                 encode_workers: int = 4, on_failure: Callable[[BaseException], None] | None = None) -> None:
        if max_batch_requests < 1:
            raise ValueError(f"max_batch_requests must be >= 1, got {max_batch_requests}")
        if encode_workers < 1:
            raise ValueError(f"encode_workers must be >= 1, got {encode_workers}")
        self.pipeline = pipeline
        self.max_batch_requests = max_batch_requests
        self.idle_wait_s = idle_wait_s
        self.profiler = profiler
        self._inbox: queue.SimpleQueue[EngineJob | None] = queue.SimpleQueue()
        self._decodes: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._waiting: list[EngineJob] = []
        self._active: list[EngineJob] = []
        self._closed = threading.Event()
        self._admission = threading.Lock()  # submit vs the loop's final drain: no job slips past it
        self.failure: BaseException | None = None
        self.on_failure = on_failure
        #: most requests one forward has carried so far (for tests and logs)
        self.largest_batch = 0
        self._loop = threading.Thread(target=self._run_loop, name="dit-loop", daemon=True)
        self._decoder = threading.Thread(target=self._run_decoder, name="dit-decode", daemon=True)
        self._encoder = ThreadPoolExecutor(max_workers=encode_workers, thread_name_prefix="dit-encode")
        self._loop.start()
        self._decoder.start()

    @property
    def active_requests(self) -> int:
        """Requests admitted and not yet finished (waiting ones not counted)."""
        return len(self._active)

    def submit(self, job: EngineJob) -> EngineJob:
        """Queue ``job`` for admission between steps; returns it.

        Raises:
            RuntimeError: the engine is closed, or its loop failed (`failure`).
        """
        with self._admission:
            if self._closed.is_set():
                raise RuntimeError(self._closed_reason())
            self._inbox.put(job)
        return job

    def _closed_reason(self) -> str:
        if self.failure is None:
            return "the DiT engine is closed"
        return f"the DiT engine failed ({type(self.failure).__name__}: {self.failure}); it takes no new work"

    def close(self, timeout: float = 10.0) -> None:
        """Stop both threads; jobs not finished get `RequestFailed(RuntimeError)`."""
        with self._admission:
            self._closed.set()
            self._inbox.put(None)
        self._loop.join(timeout)
        self._decodes.put(None)
        self._decoder.join(timeout)
        self._encoder.shutdown(wait=True)

    # -- the loop thread ---------------------------------------------------------------------

    def _run_loop(self) -> None:
        try:
            with torch.inference_mode():
                while not self._closed.is_set():
                    self._collect(block=not self._active)
                    self._reap()
                    self._admit()
                    if self._active:
                        self.step()
        except BaseException as exc:  # noqa: BLE001 - the loop's own fault: fail its jobs, never strand them
            logger.exception("DiT engine loop failed; failing its %d request(s) and refusing new ones",
                             len(self._waiting) + len(self._active))
            self.failure = exc
        with self._admission:  # after this, submit raises: nothing reaches the inbox unseen
            self._closed.set()
            self._collect(block=False)
        reason = RuntimeError(self._closed_reason())
        for job in self._waiting + self._active:
            self._leave(job)
            self._finish(job, RequestFailed(reason))
        self._waiting, self._active = [], []
        metrics.ACTIVE.set(0)
        if self.failure is not None and self.on_failure is not None:
            try:
                self.on_failure(self.failure)
            except Exception:  # noqa: BLE001 - the jobs are already failed
                logger.exception("DiT engine on_failure callback failed")

    def _collect(self, block: bool) -> None:
        """Move submitted jobs into the waiting list (blocking briefly when idle)."""
        try:
            job = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
            while True:
                if job is not None:
                    self._waiting.append(job)
                job = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _reap(self) -> None:
        """Drop cancelled jobs, waiting or active (their tensors are released at once)."""
        for group in (self._waiting, self._active):
            for job in [j for j in group if j.cancelled]:
                group.remove(job)
                self._leave(job)
                self._retire(job)
        metrics.ACTIVE.set(len(self._active))

    def _admit(self) -> None:
        """Admit waiting jobs in order while there is room: prepare conditions, build the state."""
        while self._waiting and len(self._active) < self.max_batch_requests:
            job = self._waiting.pop(0)
            try:
                job.admitted_at = time.perf_counter()
                if self.profiler is not None:
                    job.profile = self.profiler.capture(job.request_id)
                    job.profile.__enter__()
                job.state = DenoiseState(self.pipeline, job.prepare())
            except Exception as exc:  # the request's own fault (e.g. no image rows): only it fails
                self._leave(job)
                self._finish(job, RequestFailed(exc))
                continue
            self._active.append(job)
        metrics.ACTIVE.set(len(self._active))

    def step(self) -> None:
        """One step of every active request: one forward per resolution, then the events."""
        t0 = time.perf_counter()
        groups: dict[tuple[int, int], list[EngineJob]] = {}
        for job in self._active:
            groups.setdefault(job.state.resolution, []).append(job)
        for group in groups.values():
            metrics.BATCH.set(len(group))
            metrics.FORWARDS.inc()
            self.largest_batch = max(self.largest_batch, len(group))
            self._step_group(group)
        metrics.STEP.observe(time.perf_counter() - t0)
        for job in list(self._active):
            self._after_step(job)

    def _step_group(self, group: list[EngineJob]) -> None:
        """`denoise_step` over ``group``; if it raises, each job alone (a failing one fails alone)."""
        skipped = {id(j): _skipped(j) for j in group}
        graphs = getattr(self.pipeline, "step_graphs", None)
        try:
            denoise_step(self.pipeline.transformer, [j.state for j in group], graphs)
        except Exception:
            if len(group) == 1:
                raise_or_fail = group
            else:
                raise_or_fail = []
                for job in group:
                    try:
                        denoise_step(self.pipeline.transformer, [job.state], graphs)
                    except Exception:
                        raise_or_fail.append(job)
            for job in raise_or_fail:
                logger.exception("DiT step failed for request %s", job.state.request.request_id)
                self._active.remove(job)
                self._leave(job)
                self._finish(job, RequestFailed(RuntimeError("DiT step failed")))
        for job in group:
            job.step_skipped = _skipped(job) > skipped[id(job)]

    def _after_step(self, job: EngineJob) -> None:
        """Events of a job that just stepped; a finished job leaves for the decode thread."""
        state = job.state
        metrics.STEPS.inc()
        skipped = job.step_skipped
        if skipped:
            metrics.CACHE_SKIPPED.inc()
        if not self._emit(job, StepFinished(state.step, state.total, skipped)):
            return
        if state.step in job.previews:
            self._decodes.put((job, state.latents, _ready_event(state.latents), job.previews[state.step]))
        if state.done:
            ready = _ready_event(state.latents)  # may raise (a CUDA fault): the job is still the loop's
            self._active.remove(job)
            self._leave(job)
            metrics.ACTIVE.set(len(self._active))
            self._decodes.put((job, state.latents, ready, None))

    # -- the decode thread -------------------------------------------------------------------

    def _run_decoder(self) -> None:
        """Decode thread: on CUDA on its own stream (after the step that produced the latents), so
        VAE kernels can overlap the loop's next steps."""
        device = self.pipeline.device
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.inference_mode(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            while True:
                item = self._decodes.get()
                if item is None:
                    return
                job, latents, ready, preview = item
                if stream is not None and ready is not None:
                    stream.wait_event(ready)
                    latents.record_stream(stream)
                if job.cancelled:
                    if preview is None:  # the loop let go of it: only now may it be retired
                        self._retire(job)
                    continue
                try:
                    self._decode(job, latents, preview)
                except Exception as exc:  # a preview that fails is skipped; the image fails its job
                    logger.exception("DiT decode failed")
                    if preview is None:
                        self._finish(job, RequestFailed(exc))

    def _decode(self, job: EngineJob, latents: torch.Tensor, preview: int | None) -> None:
        pipe = self.pipeline
        if preview is not None:
            data = pipe.postprocess(latents, job.output_type, job.compression)
            self._emit(job, PartialImage(preview, data))
            return
        t0 = time.perf_counter()
        denoise_ms = 1000.0 * (t0 - job.admitted_at)
        image = pipe.postprocess(latents, "pt") if job.output_type != "latent" else latents
        if job.output_type in ("pt", "latent"):
            if image.is_cuda:  # the consumer's stream must not read it before this stream wrote it
                torch.cuda.current_stream(image.device).synchronize()
            self._finished(job, image, denoise_ms, 1000.0 * (time.perf_counter() - t0), 0.0)
            return
        host = image.cpu()  # on this thread's stream: after the VAE
        self._encoder.submit(self._encode, job, host, denoise_ms, 1000.0 * (time.perf_counter() - t0))

    def _encode(self, job: EngineJob, image: torch.Tensor, denoise_ms: float, vae_ms: float) -> None:
        """Encoder thread: the final image's bytes, then its terminal event."""
        if job.cancelled:
            self._retire(job)
            return
        t0 = time.perf_counter()
        try:
            data = self.pipeline.encode(image, job.output_type, job.compression)
        except Exception as exc:
            logger.exception("DiT image encoding failed")
            self._finish(job, RequestFailed(exc))
            return
        self._finished(job, data, denoise_ms, vae_ms, 1000.0 * (time.perf_counter() - t0))

    def _finished(self, job: EngineJob, output, denoise_ms: float, vae_ms: float, encode_ms: float) -> None:
        metrics.DENOISE.observe(denoise_ms / 1000.0)
        metrics.VAE.observe(vae_ms / 1000.0)
        metrics.ENCODE.observe(encode_ms / 1000.0)
        self._finish(job, ImageFinished(output, ImageTimings(denoise_ms, vae_ms, encode_ms, _skipped(job))))

    # -- events and retirement ---------------------------------------------------------------

    def _emit(self, job: EngineJob, event: EngineEvent) -> bool:
        """Deliver ``event``; a sink that raises cancels its job (returns False then)."""
        if job.cancelled:
            return False
        try:
            job.sink(event)
            return True
        except Exception:
            logger.exception("DiT event sink failed; cancelling its job")
            job.cancel()
            return False

    def _finish(self, job: EngineJob, event: ImageFinished | RequestFailed) -> None:
        """Retire ``job``, then deliver its terminal ``event``: a consumer holding the image (or
        the failure) may release the request's slot at once, the engine no longer needs it."""
        self._retire(job)
        self._emit(job, event)

    @staticmethod
    def _leave(job: EngineJob) -> None:
        """The job left the loop (done, failed or cancelled): close its profile, if any."""
        profile, job.profile = job.profile, None
        if profile is not None:
            profile.__exit__(None, None, None)

    @staticmethod
    def _retire(job: EngineJob) -> None:
        job.state = None
        if not job.retired.done():
            job.retired.set_result(None)


def _ready_event(latents: torch.Tensor):
    """A CUDA event recorded after the step that produced ``latents`` (None on the CPU)."""
    if not latents.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _skipped(job: EngineJob) -> int:
    state = job.state
    return 0 if state is None or state.cache is None else state.cache.skipped
