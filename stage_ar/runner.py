"""`ARModelRunner`: persistent per-slot decode inputs over a `KVPool`, one batched step at a time.

The runner owns the device side of decoding and nothing else: which requests run is the scheduler's
(`stage_ar.scheduler`), the arithmetic is the model's one forward (`MammothARForCausalLM.forward`,
reached only through that public call) and the one sampler (`stage_ar.sampling.GridSampler`).

Per pool slot it keeps, on the device: the next token, cache index, RoPE offset, first key position
(the AR-CFG unconditional row's prefix cut), whether the slot is active, and the slot's
`SamplingState` rows (copied from the request's own state at `activate`). A step covers slots
``[0, bucket)`` — the smallest bucket (1, 2, 4, 8, ...) holding the highest slot in use — and does,
without any host round trip:

1. the model forward of one generation token per slot with a decode attention backend
   (`stage_ar.attention`: the split-KV Triton kernel with the KV write fused in on CUDA, two GEMMs
   and a float32 softmax elsewhere) writing each row's key/value at its own cache index, the expert
   routing fixed to "all generation tokens" (no host sync), `torch.compile`d pointwise kernels on
   CUDA (`stage_ar.layers.compiled_ops`; Inductor default mode; a failing compile logs a warning
   and falls back to the eager kernels, a failing Triton kernel to the GEMM path);
2. logits of only the visual-code rows of the head (the grid constraint never samples anything
   else; EOL positions are forced);
3. `GridSampler` over the slots (CFG mix, repetition penalty, temperature, top-k/top-p, seeded
   inverse-CDF draw from the slot's uniform table, grid constraint);
4. advance each active slot (next token, cache index, sample index).

On CUDA each (batch bucket, key-length bucket, sampler variant) step is captured once as a CUDA
graph over these static buffers and replayed; the host reads only the fed/sampled ids back (one
asynchronous copy and one event per step, waited one step later, `collect`). Attention covers the
first ``L`` key positions, ``L`` the batch's longest sequence rounded up to ``length_bucket``;
``pad_to_max_bucket`` pins every step to the largest batch bucket, which makes each request's rows
independent of the other requests (batch invariance) at a small cost; its key lengths are a few
doubling buckets with the fused attention (whose bits do not depend on the length), else the whole
pool width (`_length_buckets`). The
sampler variant without the top-k/top-p sorts runs when no active request uses either (same tokens).

``exact_rows`` (default on CPU): each request's token runs through the same forward with exactly
the B=1 path's shapes and backend (SDPA over the slot's `KVCache` view, `T2ISequence.step`'s call),
so rows and tokens are bit-identical to the request decoded alone, whatever else is in the batch;
the sampler and the state handling are the same batched code. It is also the path for grid ids
that are not generation ids (the routing is computed per forward then).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from mammoth_core.cuda_streams import side_stream
from stage_ar.attention import GEMMDecodeAttention, TritonDecodeAttention
from stage_ar.fp8_activations import mark_fresh
from stage_ar.generation import T2ISequence
from stage_ar.jacobi import JacobiVerifier, WindowResult
from stage_ar.kv_pool import KVCache, KVPool
from stage_ar.layers import EAGER_OPS, compiled_ops
from stage_ar.linear import TORCH_LINEAR, set_linear_backend
from stage_ar.modeling_mammoth_ar import ExpertRouting, MammothARForCausalLM, build_key_mask
from stage_ar.sampling import GridSampler, SamplingState

__all__ = ["ARModelRunner", "StepEntry", "PendingStep"]

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_LENGTH_BUCKET = 512  # attention key-length granularity (positions)
#: With ``trim_gemv_rows``, whether the fused attention's launches are trimmed to the live rows' bucket
#: as well as the GEMVs' (`stage_ar.decode_attention.decode_attention`'s ``rows``): its idle rows'
#: programs exit at once but still fill waves (16 rows x 4 KV heads x 64 splits per layer at 4,096
#: keys). Read when a step is captured; `benchmarks/ar_inprocess_ab.py`'s ``trimattn`` group times both.
TRIM_ATTENTION = True


@dataclasses.dataclass
class StepEntry:
    """One conditional row of a launched step.

    Attributes:
        key: the caller's handle given to `ARModelRunner.activate`.
        slot: the row's pool slot.
        finished: this step fed the sequence's last grid token (its sample is the look-ahead).
    """

    key: Any
    slot: int
    finished: bool


@dataclasses.dataclass
class PendingStep:
    """A launched step whose ids have not been read back yet (see `ARModelRunner.collect`)."""

    entries: list[StepEntry]
    hidden: torch.Tensor  # (bucket, H) private copy of the step's rows
    ids_host: torch.Tensor  # (2, bucket) int64: fed, sampled (pinned on CUDA)
    event: Any


@dataclasses.dataclass
class _Slot:
    key: Any
    seq: T2ISequence
    first: int  # conditional slot; CFG uncond at first + 1
    count: int
    steps_done: int = 0
    needs_sort: bool = True  # top-k or top-p in use


def _check_grid_ids(cfg, eol: int, vstart: int, vend: int, exact_rows: bool | None) -> bool | None:
    """Validate the grid vocabulary against the model config; returns ``exact_rows`` (forced True,
    with a warning, when the grid ids are not generation ids).

    Raises:
        ValueError: an empty visual range, ids past the vocabulary, or ``exact_rows=False`` with
            grid ids that are not generation ids.
    """
    if not vstart < vend:
        raise ValueError("empty visual range")
    if min(eol, vstart) < cfg.gen_vocab_start_index:
        if exact_rows is False:
            raise ValueError("batched rows need EOL and visual codes to be generation ids")
        logger.warning("grid ids are not generation ids: stepping each request with its own forward")
        exact_rows = True
    if vend > cfg.full_vocab_size:
        raise ValueError(f"visual_token_end_id {vend} > vocabulary {cfg.full_vocab_size}")
    return exact_rows


def _length_buckets(capacity: int, length_bucket: int, *, padded: bool, exact_rows: bool,
                    fused_attention: bool) -> tuple[int, ...]:
    """The key lengths a step may attend over (one CUDA graph each per batch bucket and sampler
    variant), the pool width last.

    Bucket mode: every multiple of ``length_bucket`` below ``capacity``. Padded mode (the served,
    batch-invariant shape): ``length_bucket * 2**i`` below ``capacity`` with the fused attention,
    whose bits do not depend on the length it is given (`stage_ar.decode_attention`: the grid only),
    so a row decodes alike in every bucket; few buckets, so capture stays short (12,288 positions,
    512: six lengths, twelve graphs). Without bucketing there, the split kernel ran a program per
    split of the whole pool width for every row and step (16 slots x 12,288 positions: 96 splits
    each at the 128 keys per split of then, nearly all of them empty; H200, 2026-12-02: 4.30 ms/step against 4.19 at 8 x 4,224).
    The GEMM attention path's reductions do depend on the length, so padded mode without the
    fused kernel keeps one length: the pool width. ``length_bucket <= 0`` or ``exact_rows``: one length.
    """
    if length_bucket <= 0 or exact_rows or (padded and not fused_attention):
        return (capacity,)
    if padded:
        lengths, n = [], length_bucket
        while n < capacity:
            lengths.append(n)
            n *= 2
        return (*lengths, capacity)
    return (*range(length_bucket, capacity, length_bucket), capacity)


class ARModelRunner:
    """Continuous-batching decode state over a `KVPool`.

    Args:
        model: the AR model (eval, on its device/dtype).
        num_slots: pool slots (a CFG request takes two adjacent ones).
        capacity: positions per slot (prompt + grid of the largest request).
        eol_token_id, visual_token_start_id, visual_token_end_id: the grid vocabulary
            (`T2IGenerationConfig`); all must be generation ids (``>= gen_vocab_start_index``).
        exact_rows: per-request B=1-shaped forwards (bit-identical rows); default True on CPU.
        cuda_graphs: capture each bucket's step; default True on CUDA (ignored elsewhere/with exact_rows).
        buckets: batch sizes a step may run at (slots ``[0, bucket)``).
        pad_to_max_bucket: always run the largest bucket (one batch shape for every step).
        compile: fuse each layer's elementwise chain with `torch.compile` (see module doc); default
            True on CUDA without ``exact_rows``, False elsewhere. Falls back to the eager helpers
            with a logged warning when compilation fails.
        length_bucket: attention covers the batch's longest sequence rounded up to a multiple of
            this many positions (0: always the pool width); with ``pad_to_max_bucket``, to this
            many times a power of two, and only with ``fused_attention`` (`_length_buckets`).
        fused_attention: attention by `stage_ar.decode_attention` (split-KV Triton kernel, KV
            write fused in, batch-invariant by construction); default True on CUDA when triton is
            importable, else the eager GEMM + softmax path. Ignored with ``exact_rows``; on CPU
            only under Triton's interpreter (tests).
        trim_gemv_rows: with ``pad_to_max_bucket``, the GEMV launches of a step compute only the
            rows up to the last active slot, rounded up to a batch bucket (one graph per such row
            bucket too), and the fused attention's alike (`TRIM_ATTENTION`); every other kernel
            still runs all rows, and a computed row's bits do not change (`stage_ar.gemv.gemv`'s and
            `stage_ar.decode_attention.decode_attention`'s ``rows``), so rows stay batch-invariant. Idle slots' rows
            are then garbage past the GEMVs (their attention reads and writes no KV; nothing reads
            them). Only with ``fused_attention`` (the GEMM path writes every row's KV): ignored
            otherwise. The engine's served (``batch_invariant``) mode turns it on: one request in
            the 16-slot served shape, -61 us per step in a `mammoth ar` process on an H100
            (docs/PERFORMANCE.md, twentieth session). Needs a backend whose
            `LinearBackend.rows_computed` does it (`GemvLinear`); otherwise no-op.

    Raises:
        ValueError: a grid id below ``gen_vocab_start_index`` or an empty visual range.
    """

    def __init__(
        self,
        model: MammothARForCausalLM,
        num_slots: int,
        capacity: int,
        *,
        eol_token_id: int,
        visual_token_start_id: int,
        visual_token_end_id: int,
        exact_rows: bool | None = None,
        cuda_graphs: bool | None = None,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        pad_to_max_bucket: bool = False,
        compile: bool | None = None,  # noqa: A002 - the option's natural name
        length_bucket: int = DEFAULT_LENGTH_BUCKET,
        fused_attention: bool | None = None,
        trim_gemv_rows: bool = False,
    ) -> None:
        cfg = model.config
        exact_rows = _check_grid_ids(cfg, eol_token_id, visual_token_start_id, visual_token_end_id, exact_rows)
        param = model.lm_head.weight
        self.model = model
        self.device, self.dtype = param.device, param.dtype
        self.on_cuda = self.device.type == "cuda"
        self.exact_rows = (not self.on_cuda) if exact_rows is None else bool(exact_rows)
        want_graphs = self.on_cuda if cuda_graphs is None else bool(cuda_graphs)
        self.cuda_graphs = want_graphs and self.on_cuda and not self.exact_rows
        self.pool = KVPool(cfg, num_slots, capacity, device=self.device, dtype=self.dtype)
        self.capacity = self.pool.capacity
        self.num_slots = num_slots
        self.buckets = tuple(sorted({min(b, num_slots) for b in buckets} | {num_slots}))
        self.pad_to_max_bucket = pad_to_max_bucket
        want_compile = (self.on_cuda and not self.exact_rows) if compile is None else bool(compile)
        self.compile = want_compile and not self.exact_rows
        self._ops = compiled_ops() if self.compile else EAGER_OPS
        can_fuse = TritonDecodeAttention.available(self.device) and not self.exact_rows
        want_fused = self.on_cuda if fused_attention is None else bool(fused_attention)
        self.fused_attention = want_fused and can_fuse
        if fused_attention and not self.fused_attention:
            logger.warning("fused decode attention unavailable (needs CUDA and triton); using the GEMM path")
        self.trim_gemv_rows = bool(trim_gemv_rows) and pad_to_max_bucket and self.fused_attention
        self.length_bucket = length_bucket
        self.length_buckets: tuple[int, ...] = self._length_buckets()
        self.eol = int(eol_token_id)
        self.vstart, self.vend = int(visual_token_start_id), int(visual_token_end_id)
        self.vocab = self.vend - self.vstart
        self.scale = cfg.head_dim**-0.5
        self._slots: dict[int, _Slot] = {}  # by conditional slot
        self.steps_launched = 0
        self._allocate_slot_state(num_slots)
        # by (batch bucket, key length, sorted sampler, GEMV rows)
        self._graphs: dict[tuple[int, int, bool, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self._graph_pool = None
        self.jacobi = JacobiVerifier(self)  # the ``jacobi`` sequences' windows (stage_ar.jacobi)

    def _length_buckets(self) -> tuple[int, ...]:
        return _length_buckets(self.capacity, self.length_bucket, padded=self.pad_to_max_bucket,
                               exact_rows=self.exact_rows, fused_attention=self.fused_attention)

    def _allocate_slot_state(self, n: int) -> None:
        """The persistent per-slot inputs the captured steps read and write (``n`` slots)."""
        dev = self.device
        i64 = dict(device=dev, dtype=torch.long)
        self.next_token = torch.full((n,), self.eol, **i64)
        self.cache_pos = torch.zeros(n, **i64)
        self.rope_off = torch.zeros(n, **i64)
        self.key_start = torch.zeros(n, **i64)
        self.active = torch.zeros(n, device=dev, dtype=torch.bool)
        self.rows = torch.arange(n, **i64)
        self.sampler = GridSampler(self.eol, self.vstart, self.vend, dev)
        self.sampling = SamplingState.allocate(n, self.vocab, self.capacity + 1, dev)

    # ---- set-up ---------------------------------------------------------------------------------

    def _shapes(self) -> list[tuple[int, int, bool, int]]:
        buckets = self.buckets[-1:] if self.pad_to_max_bucket else self.buckets
        return [(b, n, sort, rows) for b in buckets for n in self.length_buckets for sort in (True, False)
                for rows in (self.buckets if self.trim_gemv_rows else (b,))]

    def _run_step(self, b: int, length: int, sort: bool, rows: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_step_impl`, falling back (logged) to the GEMM attention path if the fused attention
        kernel fails, then to torch matmul if a GEMV linear kernel fails, then to the eager helpers if a
        compiled one fails (Triton needs a C compiler
        and Python headers at run time to build its launchers; an image without them lands here).

        A retry is safe: the first compiled or Triton call precedes every state write except the KV
        write of the new position, which the retry repeats with the same values.
        """
        while True:
            try:
                return self._step_impl(b, length, sort, rows)
            except Exception as exc:  # noqa: BLE001 - Inductor/Triton failures of many kinds
                if self.fused_attention:
                    logger.warning("fused decode attention failed (%s: %s); using the GEMM attention path",
                                   type(exc).__name__, exc)
                    self.fused_attention = False
                    self.length_buckets = self._length_buckets()  # padded: the GEMM path's one length
                    if length not in self.length_buckets:
                        length = self.capacity
                elif self.model.linear_backend is not TORCH_LINEAR:
                    logger.warning("GEMV linear kernels failed (%s: %s); using torch matmul", type(exc).__name__, exc)
                    set_linear_backend(self.model, TORCH_LINEAR)
                elif self._ops.compiled:
                    logger.warning("torch.compile of the decode step failed (%s: %s); using eager kernels",
                                   type(exc).__name__, exc)
                    self._ops = EAGER_OPS
                    self.compile = False
                else:
                    raise

    def capture(self) -> None:
        """Compile (if on) and capture one CUDA graph per (batch bucket, key-length bucket, sampler
        variant, GEMV rows); no-op without ``cuda_graphs`` or when already captured.

        Raises:
            RuntimeError: a request is active. Warm-up and capture run real steps over every slot;
                an active request's cache position, next token and sample index would advance
                (found on the H200: a lazily captured engine fed the wrong token after capture).
        """
        if self._slots:
            raise RuntimeError(f"capture() with {len(self._slots)} active request(s) would advance their state")
        if not self.cuda_graphs or self._graphs:
            return
        torch.cuda.synchronize(self.device)
        stream = side_stream(self.device, "graph-warm-up")  # one per process: see mammoth_core.cuda_streams
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            # warm-up off the capture: compilation, cuBLAS handles, attention kernels
            for b, n, sort, rows in self._shapes():
                for _ in range(2 if n == self.length_buckets[0] else 1):
                    self._run_step(b, n, sort, rows)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        for shape in sorted(self._shapes(), reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self._graph_pool):
                outs = self._step_impl(*shape)
            if self._graph_pool is None:
                self._graph_pool = graph.pool()
            self._graphs[shape] = (graph, outs)
        torch.cuda.synchronize(self.device)

    # ---- membership -----------------------------------------------------------------------------

    @property
    def graphs_captured(self) -> int:
        """CUDA graphs captured (one per batch bucket x key-length bucket x sampler variant x GEMV rows)."""
        return len(self._graphs)

    def graph(self, shape: tuple[int, int, bool, int]) -> Any:
        """The captured CUDA graph of ``shape`` (see `next_shape`), or None (benchmarks replay it)."""
        entry = self._graphs.get(shape)
        return entry[0] if entry else None

    @property
    def active_count(self) -> int:
        """Requests decoding now (sequential and Jacobi)."""
        return len(self._slots) + len(self.jacobi)

    def kv_view(self, first: int, count: int) -> KVCache:
        """A `KVCache` over pool slots ``[first, first + count)`` (length 0) for a prefill."""
        return self.pool.view(first, count)

    @torch.inference_mode()
    def activate(self, key: Any, seq: T2ISequence, first: int) -> None:
        """Load a prefilled sequence's decode state into its slots; it joins the next step.

        ``key`` comes back in `StepEntry.key`. Draws the request's remaining uniforms (see module doc).
        """
        if seq.finished or seq.next_token is None:
            raise ValueError("activate() needs a prefilled, unfinished sequence")
        if seq.decoding.jacobi:
            self.active[first : first + seq.cache_batch] = False
            self.jacobi.activate(key, seq, first)
            return
        count = seq.cache_batch
        g0 = len(seq.generated_ids)
        ints = torch.tensor([seq.next_token, seq.prompt_len + g0], dtype=torch.long)
        span = slice(first, first + count)
        self.next_token[span] = ints[0].to(self.device)
        self.cache_pos[span] = ints[1].to(self.device)
        self.rope_off[span] = torch.tensor(seq.position_offsets, dtype=torch.long).to(self.device)
        self.key_start[span] = torch.tensor(seq.key_starts, dtype=torch.long).to(self.device)
        self.active[span] = True
        mark_fresh(span, self.device)  # delayed activation scales (opt-in W8A8 experiment): no amax of the slot's last request
        state = seq.sampling_state
        state.copy_into(self.sampling, first)
        self._slots[first] = _Slot(key, seq, first, count, steps_done=g0, needs_sort=state.needs_sort)

    def deactivate(self, first: int, key: Any = None) -> Any:
        """Remove the request at ``first`` (finished or cancelled) from the batch; returns its key.
        Its slots stay the scheduler's to give out again.

        With ``key``, only when that request still holds the slot (no-op otherwise).
        """
        if first in self.jacobi:
            return self.jacobi.deactivate(first, key)
        st = self._slots.get(first)
        if st is None or (key is not None and st.key is not key):
            return None
        del self._slots[first]
        span = slice(first, first + st.count)
        self.active[span] = False
        self.sampling.clear(first, st.count)
        return st.key

    # ---- stepping -------------------------------------------------------------------------------

    def _bucket(self) -> int:
        return self.buckets[-1] if self.pad_to_max_bucket else self._live_bucket()

    def _live_bucket(self) -> int:
        """The smallest batch bucket holding every active slot."""
        need = max(st.first + st.count for st in self._slots.values())
        return next(b for b in self.buckets if b >= need)

    def next_shape(self) -> tuple[int, int, bool, int]:
        """(batch bucket, key-length bucket, sorted sampler, GEMV rows) of the next step; the GEMV
        rows are the batch bucket's unless ``trim_gemv_rows``."""
        need = max(st.seq.prompt_len + st.steps_done + 1 for st in self._slots.values())
        length = next((n for n in self.length_buckets if n >= need), self.capacity)
        b = self._bucket()
        rows = self._live_bucket() if self.trim_gemv_rows else b
        return b, length, any(st.needs_sort for st in self._slots.values()), rows

    @torch.inference_mode()
    def launch(self) -> PendingStep | None:
        """Run one decode step for every active request (asynchronously on CUDA).

        Requests whose last grid token this step feeds are deactivated (slots freed) right away;
        their entries say ``finished``. Returns None when nothing is active.
        """
        if not self._slots:
            return None
        shape = self.next_shape()
        if shape in self._graphs:
            graph, (hidden, fed, sampled) = self._graphs[shape]
            graph.replay()
        else:
            hidden, fed, sampled = self._run_step(*shape)
        self.steps_launched += 1
        hidden = hidden.clone()  # the graph's buffers are overwritten by the next replay
        ids = torch.stack([fed, sampled])
        event = None
        if self.on_cuda:
            ids_host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            ids_host.copy_(ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            ids_host = ids
        entries: list[StepEntry] = []
        for first in sorted(self._slots):
            st = self._slots[first]
            st.steps_done += 1
            done = st.steps_done == st.seq.grid_tokens
            entries.append(StepEntry(st.key, first, done))
            if done:
                self.deactivate(first)
        return PendingStep(entries, hidden, ids_host, event)

    def speculate(self) -> list[WindowResult]:
        """One verification turn of every Jacobi window (synchronous; `JacobiVerifier.step`)."""
        return self.jacobi.step() if len(self.jacobi) else []

    @staticmethod
    def collect(pending: PendingStep) -> tuple[list[int], list[int]]:
        """Wait for ``pending``'s ids (host sync on its event) and return ``(fed, sampled)`` per slot."""
        if pending.event is not None:
            pending.event.synchronize()
        fed, sampled = pending.ids_host.tolist()
        return fed, sampled

    def _step_impl(
        self, b: int, length: int | None = None, sort: bool = True, rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step over slots ``[0, b)``, attending over the first ``length`` key positions (all by
        default), with the top-k/top-p sorts or not, the GEMV launches computing the first ``rows``
        rows (``trim_gemv_rows``; None: all; only with the fused attention, which keeps idle rows out
        of the KV pool): returns ``(hidden (b, H), fed (b,), sampled (b,))``; rows of idle slots at or
        past ``rows`` are garbage."""
        length = self.capacity if length is None else length
        active = self.active[:b]
        fed = self.next_token[:b].clone()
        pos = self.cache_pos[:b]
        if self.exact_rows:
            hidden, logits = self._forward_exact(b, fed)
        else:
            trim = rows is not None and rows < b and self.fused_attention
            with self.model.linear_backend.rows_computed(rows if trim else None):
                hidden = self._forward_batched(b, fed, pos, length, rows if trim and TRIM_ATTENTION else None)
                logits = self.model.compute_logits(hidden, self.vstart, self.vend)
        self.sampler.mark_seen(self.sampling, fed, active)
        tokens = self.sampler(logits, self.sampling, sort)
        self.next_token[:b] = torch.where(active, tokens, fed)
        step = active.long()
        self.cache_pos[:b] += step
        self.sampling.sample_idx[:b] += step
        return hidden, fed, tokens

    def _forward_batched(self, b: int, fed: torch.Tensor, pos: torch.Tensor, length: int,
                         rows: int | None = None) -> torch.Tensor:
        """The model's forward over slots ``[0, b)``, one new (generation) token each at cache
        position ``pos``, attending over key positions ``[0, length)`` of the pool; ``(b, H)``.
        ``rows``: the fused attention launches rows ``[0, rows)`` only (`_step_impl`'s trim)."""
        # idle slots' rows read no KV and write none (`decode_attention`'s ``live``); their GEMV rows
        # still load their activations (a mask in the kernel measured slower, docs/PERFORMANCE.md),
        # except past the live bucket with ``trim_gemv_rows`` (the graph's launches take fewer rows,
        # the attention's too)
        live = self.active[:b]
        if self.fused_attention:
            attention = TritonDecodeAttention(self.pool.key, self.pool.value, pos, self.key_start[:b], length,
                                              self.scale, live=live, rows=rows)
        else:
            attention = GEMMDecodeAttention(self.pool.key, self.pool.value, pos, self.key_start[:b], length,
                                            self.scale, ops=self._ops)
        ids = fed[:, None]
        out = self.model(ids, (pos + self.rope_off[:b])[:, None], compute_logits=False, attention=attention,
                         routing=ExpertRouting.all_generation(ids), ops=self._ops)
        return out.last_hidden_state[:, 0]

    def _forward_exact(self, b: int, fed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per request, the B=1 path's exact forward (`MammothARForCausalLM.forward` on the slots'
        `KVCache` view, full head, visual slice). Host-side state; CPU/debug only."""
        hidden = torch.zeros(b, self.model.config.hidden_size, device=self.device, dtype=self.dtype)
        logits = torch.zeros(b, self.vocab, device=self.device, dtype=torch.float32)
        fed_host = fed.tolist()
        for first, st in self._slots.items():
            seq, n = st.seq, st.count
            g = st.steps_done
            length = seq.prompt_len + g
            cache = self.pool.view(first, n)
            cache.length = length
            ids = torch.tensor([[fed_host[first]]] * n, dtype=torch.long, device=self.device)
            offsets = seq.position_offsets
            positions = torch.tensor([[length + offsets[r]] for r in range(n)], dtype=torch.long, device=self.device)
            mask = build_key_mask(seq.key_starts, length + 1, self.device) if seq.cfg else None
            out = self.model(ids, positions, kv_cache=cache, attention_mask=mask, compute_logits=False)
            last = out.last_hidden_state[:, -1]
            hidden[first : first + n] = last
            logits[first : first + n] = self.model.compute_logits(last, self.vstart, self.vend)
        return hidden, logits
