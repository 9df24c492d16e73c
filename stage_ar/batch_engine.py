"""Batched AR decode over a `KVPool`: one forward + fused grid-constrained sampling per step.

`BatchedDecoder` keeps every running sequence's decode state on the device, one entry per pool slot
(next token, cache index, RoPE offset, key start, sample index, grid width, sampling parameters, the
uniform stream, the repetition-penalty "seen" mask). A step covers slots ``[0, bucket)`` — the
smallest bucket (1, 2, 4, 8, 16, ...) holding the highest slot in use — and does, without any host
round trip:

1. embed the fed tokens (all generation ids: EOL or visual codes), run every decoder layer with the
   generation experts where the layer has them, write the new key/value at each row's own cache
   index and attend with a per-row length mask over the fixed pool width;
2. final norm, then logits of only the visual-code rows of the output head
   (``[visual_token_start, visual_token_end)``: the grid constraint never lets anything else be
   sampled, and EOL positions are forced without logits);
3. AR-CFG mix (row + partner row), repetition penalty, temperature, top-k, top-p, float64 softmax,
   inverse-CDF draw with the row's next uniform, EOL forced where ``col == ar_width``;
4. advance each active slot's state (next token, cache index, sample index).

On CUDA each bucket's step is captured once as a CUDA graph over static buffers and replayed; the
host only reads the fed/sampled ids back (one asynchronous copy and one event per step, waited one
step later) and hands the hidden rows to the sender.

Random numbers: sampling must draw exactly what `GridConstrainedSampler.sample` draws from the
request's seeded CPU generator (one float64 uniform per non-EOL sample, none when greedy). At join
the decoder draws the request's remaining uniforms from that same generator in one call
(``torch.rand(n, dtype=float64)`` yields the same values as ``n`` scalar draws: CPU Mersenne
Twister, sequential) and uploads them as the slot's uniform table indexed by sample number. The
generator ends in the state the B=1 path would leave it in.

``exact_rows`` (default on CPU): the linear layers, attention and output head run per request with
exactly the shapes of the B=1 path (`MammothARForCausalLM.forward` on the slot's `KVCache` view,
the full head then the visual slice), so rows and tokens are bit-identical to `T2ISequence.step`
whatever else is in the batch; the sampler and all state handling are the same batched code. On
CUDA the rows are computed batched (bf16 GEMMs whose kernels may depend on the batch size, so rows
equal the B=1 path to bf16 rounding); ``pad_to_max_bucket`` pins every step to one shape, which makes
each request's rows independent of the other requests (batch invariance) at a small cost.

Kernel count (CUDA, ``compile``): each layer's elementwise chain is fused by `torch.compile`d
helpers (RMSNorm, residual add + RMSNorm, RoPE of q and k, scaled + masked float32 softmax,
SiLU·mul; Inductor, default mode, no split reductions) called inside the captured step, so a layer
is its GEMMs plus ≈ 6 small kernels instead of ≈ 30. Compilation happens during `capture`'s
warm-up; if it fails the decoder logs a warning and keeps the eager helpers (same operations as the
model's modules). Compiled kernels are per shape, so only ``pad_to_max_bucket`` keeps a request's
rows independent of the rest of the batch (measured on the H200: docs/PERFORMANCE.md). Attention covers the first ``L`` key positions only, ``L`` the batch's longest
sequence rounded up to ``length_bucket`` (one graph per (batch bucket, length bucket)); with
``pad_to_max_bucket`` ``L`` is pinned to the pool width so every step keeps one shape. On CUDA
the attention and the KV-cache write are one split-KV Triton kernel pair
(`stage_ar.decode_attention`): tiles past a row's position are skipped, so padded rows and long
length buckets cost little, and a row's attention is batch-invariant by construction. The sampler
has a variant without the two sorts of top-k/top-p, used when no running request asks for either
(the sorted variant leaves the scores untouched in that case, so both give identical tokens).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F

from stage_ar.decode_attention import available as decode_attention_available
from stage_ar.decode_attention import decode_attention
from stage_ar.generation import T2ISequence
from stage_ar.kv_pool import KVPool
from stage_ar.modeling_mammoth_ar import MammothARForCausalLM, rotate_half
from stage_ar.sampling import MIN_TOKENS_TO_KEEP

__all__ = ["BatchedDecoder", "StepEntry", "PendingStep"]

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_LENGTH_BUCKET = 512  # attention key-length granularity (positions)


# ---- per-layer elementwise chains (eager; `torch.compile`d on CUDA) ------------------------------


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`MammothRMSNorm.forward` as a function: statistics in float32, cast before the weight."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add then RMSNorm: returns ``(x + delta, rms_norm(x + delta))``."""
    x = x + delta
    return x, _rms_norm(x, weight, eps)


def _rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int):
    """Split a fused q/k/v row block ``(b, (heads + 2 kv_heads) * d)`` and rotate q and k (RoPE).

    ``cos``/``sin``: ``(b, 1, d)``. Returns q ``(b, heads, d)``, k and v ``(b, kv_heads, d)``.
    """
    b = qkv.shape[0]
    d = cos.shape[-1]
    q_out, kv_out = heads * d, kv_heads * d
    q = qkv[:, :q_out].view(b, heads, d)
    k = qkv[:, q_out : q_out + kv_out].view(b, kv_heads, d)
    v = qkv[:, q_out + kv_out :].view(b, kv_heads, d)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    return q, k, v


def _masked_softmax(scores: torch.Tensor, scale: float, bias: torch.Tensor) -> torch.Tensor:
    """``softmax(scores * scale + bias)`` in float32, cast back to the scores' dtype."""
    return torch.softmax(scores.float() * scale + bias, dim=-1).to(scores.dtype)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation ``silu(gate) * up``."""
    return F.silu(gate) * up


_EAGER_KERNELS: dict[str, Callable] = {
    "rms_norm": _rms_norm, "add_rms_norm": _add_rms_norm, "rope_qkv": _rope_qkv,
    "masked_softmax": _masked_softmax, "silu_mul": _silu_mul,
}
_COMPILED_KERNELS: dict[str, Callable] | None = None


def _compiled_kernels() -> dict[str, Callable]:
    """`torch.compile`d versions of the helpers (built once per process, shared by decoders).

    Inductor default mode (no CUDA graphs of its own: the decoder captures the whole step), split
    reductions requested off. Inductor still generates per-shape kernels (batch 1 specialised, and
    on the H200 it split the softmax reduction anyway), so in bucket mode a row's reduction order
    may depend on the batch bucket; ``pad_to_max_bucket`` (one shape) stays batch-invariant.
    """
    global _COMPILED_KERNELS  # noqa: PLW0603 - one compile cache per process
    if _COMPILED_KERNELS is None:
        try:
            opts: dict[str, Any] | None = {"split_reductions": False}
            torch.compile(_silu_mul, options=opts)  # validates the option names
        except Exception:  # noqa: BLE001 - an Inductor without that option
            opts = None
        _COMPILED_KERNELS = {name: torch.compile(fn, options=opts) for name, fn in _EAGER_KERNELS.items()}
    return _COMPILED_KERNELS


@dataclasses.dataclass
class StepEntry:
    """One conditional row of a launched step.

    Attributes:
        key: the caller's handle given to `BatchedDecoder.activate`.
        slot: the row's pool slot.
        finished: this step fed the sequence's last grid token (its sample is the look-ahead).
    """

    key: Any
    slot: int
    finished: bool


@dataclasses.dataclass
class PendingStep:
    """A launched step whose ids have not been read back yet (see `BatchedDecoder.collect`)."""

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


class BatchedDecoder:
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
        pad_to_max_bucket: always run the largest bucket and attend over the whole pool width
            (one shape for every step).
        compile: fuse each layer's elementwise chain with `torch.compile` (see module doc); default
            True on CUDA without ``exact_rows``, False elsewhere. Falls back to the eager helpers
            with a logged warning when compilation fails.
        length_bucket: attention covers the batch's longest sequence rounded up to a multiple of
            this many positions (0: always the pool width). Ignored with ``pad_to_max_bucket``.
        fused_attention: attention by `stage_ar.decode_attention` (split-KV Triton kernel, KV
            write fused in, batch-invariant by construction); default True on CUDA when triton is
            importable, else the eager GEMM + softmax path. Ignored with ``exact_rows``; on CPU
            only under Triton's interpreter (tests).

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
    ) -> None:
        cfg = model.config
        if not visual_token_start_id < visual_token_end_id:
            raise ValueError("empty visual range")
        if min(eol_token_id, visual_token_start_id) < cfg.gen_vocab_start_index:
            raise ValueError("the batched decoder needs EOL and visual codes to be generation ids")
        if visual_token_end_id > cfg.full_vocab_size:
            raise ValueError(f"visual_token_end_id {visual_token_end_id} > vocabulary {cfg.full_vocab_size}")
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
        self._kernels = _compiled_kernels() if self.compile else _EAGER_KERNELS
        can_fuse = decode_attention_available(self.device) and not self.exact_rows
        want_fused = self.on_cuda if fused_attention is None else bool(fused_attention)
        self.fused_attention = want_fused and can_fuse
        if fused_attention and not self.fused_attention:
            logger.warning("fused decode attention unavailable (needs CUDA and triton); using the GEMM path")
        if pad_to_max_bucket or length_bucket <= 0 or self.exact_rows:
            self.length_buckets: tuple[int, ...] = (self.capacity,)
        else:
            self.length_buckets = tuple(range(length_bucket, self.capacity, length_bucket)) + (self.capacity,)
        self.eol = int(eol_token_id)
        self.vstart, self.vend = int(visual_token_start_id), int(visual_token_end_id)
        self.vocab = self.vend - self.vstart
        self.head_weight = self._visual_head_weight()
        self._qkv = self._fused_qkv() if not self.exact_rows else []
        self._slots: dict[int, _Slot] = {}  # by conditional slot
        self.steps_launched = 0

        dev, n = self.device, num_slots
        i64 = dict(device=dev, dtype=torch.long)
        self.next_token = torch.full((n,), self.eol, **i64)
        self.cache_pos = torch.zeros(n, **i64)
        self.rope_off = torch.zeros(n, **i64)
        self.key_start = torch.zeros(n, **i64)
        self.sample_idx = torch.zeros(n, **i64)
        self.width = torch.ones(n, **i64)
        self.partner = torch.arange(n, **i64)
        self.source = torch.arange(n, **i64)
        self.top_k = torch.full((n,), self.vocab, **i64)
        self.active = torch.zeros(n, device=dev, dtype=torch.bool)
        self.has_partner = torch.zeros(n, device=dev, dtype=torch.bool)
        self.greedy = torch.zeros(n, device=dev, dtype=torch.bool)
        self.use_top_p = torch.zeros(n, device=dev, dtype=torch.bool)
        f32 = dict(device=dev, dtype=torch.float32)
        self.temperature = torch.ones(n, **f32)
        self.top_p_cut = torch.zeros(n, **f32)  # 1 - top_p, computed in float64 on the host as upstream
        self.penalty = torch.ones(n, **f32)
        self.cfg_scale = torch.ones(n, **f32)
        self.uniforms = torch.zeros(n, self.capacity + 1, device=dev, dtype=torch.float64)
        self.seen = torch.zeros(n, self.vocab, device=dev, dtype=torch.bool)
        self.rows = torch.arange(n, **i64)
        self.key_index = torch.arange(self.capacity, **i64)
        self.vocab_index = torch.arange(self.vocab, **i64)
        # by (batch bucket, key length, sorted sampler)
        self._graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self._graph_pool = None

    # ---- set-up ---------------------------------------------------------------------------------

    def _visual_head_weight(self) -> torch.Tensor:
        """Rows ``[vstart, vend)`` of the concatenated head ``[lm_head; gen_head]`` (a view when the
        range lies in one head)."""
        cfg, m = self.model.config, self.model
        base = m.lm_head.weight
        if self.vend <= cfg.vocab_size:
            return base[self.vstart : self.vend]
        gen = m.gen_head.weight
        if self.vstart >= cfg.vocab_size:
            return gen[self.vstart - cfg.vocab_size : self.vend - cfg.vocab_size]
        return torch.cat([base[self.vstart :], gen[: self.vend - cfg.vocab_size]])

    def _fused_qkv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the q/k/v projections a generation token uses, concatenated into one weight
        ``(q_out + 2*kv_out, hidden)`` and bias: one GEMM instead of three (copies, taken now)."""
        fused = []
        for layer in self.model.language_model.layers:
            a = layer.self_attn
            mods = (a.gen_q_proj, a.gen_k_proj, a.gen_v_proj) if a.has_experts else (a.q_proj, a.k_proj, a.v_proj)
            fused.append((torch.cat([m.weight for m in mods]), torch.cat([m.bias for m in mods])))
        return fused

    def _shapes(self) -> list[tuple[int, int, bool]]:
        buckets = self.buckets[-1:] if self.pad_to_max_bucket else self.buckets
        return [(b, n, sort) for b in buckets for n in self.length_buckets for sort in (True, False)]

    def _run_step(self, b: int, length: int, sort: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_step_impl`, falling back (logged) to the GEMM attention path if the fused attention
        kernel fails, then to the eager helpers if a compiled one fails (Triton needs a C compiler
        and Python headers at run time to build its launchers; an image without them lands here).

        A retry is safe: the first compiled or Triton call precedes every state write except the KV
        write of the new position, which the retry repeats with the same values.
        """
        while True:
            try:
                return self._step_impl(b, length, sort)
            except Exception as exc:  # noqa: BLE001 - Inductor/Triton failures of many kinds
                if self.fused_attention:
                    logger.warning("fused decode attention failed (%s: %s); using the GEMM attention path",
                                   type(exc).__name__, exc)
                    self.fused_attention = False
                elif self._kernels is not _EAGER_KERNELS:
                    logger.warning("torch.compile of the decode step failed (%s: %s); using eager kernels",
                                   type(exc).__name__, exc)
                    self._kernels = _EAGER_KERNELS
                    self.compile = False
                else:
                    raise

    def capture(self) -> None:
        """Compile (if on) and capture one CUDA graph per (batch bucket, key-length bucket, sampler
        variant); no-op without ``cuda_graphs``. Call with no request active."""
        if not self.cuda_graphs or self._graphs:
            return
        torch.cuda.synchronize(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            # warm-up off the capture: compilation, cuBLAS handles, attention kernels
            for b, n, sort in self._shapes():
                for _ in range(2 if n == self.length_buckets[0] else 1):
                    self._run_step(b, n, sort)
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
    def active_count(self) -> int:
        """Requests decoding now."""
        return len(self._slots)

    def reserve(self, seq: T2ISequence) -> int:
        """Allocate slots for ``seq`` and attach their `KVCache` view (call before ``seq.prefill()``).

        Returns:
            the first slot.

        Raises:
            ValueError: the sequence needs more positions than the pool's capacity.
            stage_ar.kv_pool.PoolFull: no free slots.
        """
        if seq.total_rows > self.capacity:
            raise ValueError(f"sequence needs {seq.total_rows} positions; the decode pool holds {self.capacity}")
        count = seq.cache_batch
        first = self.pool.alloc(count)
        try:
            seq.attach_kv_cache(self.pool.view(first, count))
        except Exception:
            self.pool.free(first, count)
            raise
        return first

    def unreserve(self, first: int, count: int) -> None:
        """Give back slots of a sequence that never became active (failed prefill)."""
        self.pool.free(first, count)

    @torch.inference_mode()
    def activate(self, key: Any, seq: T2ISequence, first: int) -> None:
        """Load a prefilled sequence's decode state into its slots; it joins the next step.

        ``key`` comes back in `StepEntry.key`. Draws the request's remaining uniforms (see module doc).
        """
        if seq.finished or seq.next_token is None:
            raise ValueError("activate() needs a prefilled, unfinished sequence")
        s = seq.sampler
        count = seq.cache_batch
        g0 = len(seq.generated_ids)
        samples_left = range(seq.tokens_sampled, seq.total_samples)
        table = torch.zeros(self.capacity + 1, dtype=torch.float64)
        if not s.greedy:
            draws = [i for i in samples_left if not s.is_eol_position(i)]
            if draws:
                values = torch.rand(len(draws), generator=s.generator, dtype=torch.float64)
                table[torch.tensor(draws)] = values
        seen = torch.zeros(self.vocab, dtype=torch.bool)
        if s.repetition_penalty != 1.0:
            ids = torch.tensor(seq.prompt_ids + seq.generated_ids, dtype=torch.long) - self.vstart
            seen[ids[(ids >= 0) & (ids < self.vocab)]] = True
        k = self.vocab if s.top_k is None else min(max(s.top_k, MIN_TOKENS_TO_KEEP), self.vocab)
        offsets = seq.position_offsets
        key_starts = [0] * count
        if seq.cfg:
            key_starts[1] = int((~seq._key_mask[1]).sum())  # noqa: SLF001 - the uncond prefix cut
        for r in range(count):
            slot = first + r
            ints = torch.tensor(
                [
                    seq.next_token, seq.prompt_len + g0, offsets[r], key_starts[r], seq.tokens_sampled,
                    s.ar_width, first + 1 if (seq.cfg and r == 0) else slot, first if seq.cfg else slot, k,
                ],
                dtype=torch.long,
            )
            for tensor, value in zip(
                (self.next_token, self.cache_pos, self.rope_off, self.key_start, self.sample_idx, self.width,
                 self.partner, self.source, self.top_k),
                ints.to(self.device),
            ):
                tensor[slot] = value
            flags = torch.tensor([True, seq.cfg and r == 0, s.greedy, s.top_p < 1.0], device=self.device)
            self.active[slot], self.has_partner[slot], self.greedy[slot], self.use_top_p[slot] = flags
            floats = torch.tensor(
                [s.temperature if not s.greedy else 1.0, 1.0 - s.top_p, s.repetition_penalty, seq.ar_guidance_scale],
                dtype=torch.float32,
            ).to(self.device)
            self.temperature[slot], self.top_p_cut[slot], self.penalty[slot], self.cfg_scale[slot] = floats
            self.uniforms[slot].copy_(table)
            self.seen[slot].copy_(seen)
        needs_sort = k < self.vocab or s.top_p < 1.0
        self._slots[first] = _Slot(key, seq, first, count, steps_done=g0, needs_sort=needs_sort)

    def deactivate(self, first: int, key: Any = None) -> Any:
        """Remove the request at ``first`` (finished or cancelled) and free its slots; returns its key.

        With ``key``, only when that request still holds the slot (no-op otherwise).
        """
        st = self._slots.get(first)
        if st is None or (key is not None and st.key is not key):
            return None
        del self._slots[first]
        span = slice(first, first + st.count)
        self.active[span] = False
        self.has_partner[span] = False
        self.partner[span] = self.rows[span]
        self.source[span] = self.rows[span]
        self.pool.free(first, st.count)
        return st.key

    # ---- stepping -------------------------------------------------------------------------------

    def _bucket(self) -> int:
        if self.pad_to_max_bucket:
            return self.buckets[-1]
        need = max(st.first + st.count for st in self._slots.values())
        return next(b for b in self.buckets if b >= need)

    def _shape(self) -> tuple[int, int, bool]:
        """(batch bucket, key-length bucket, sorted sampler) of the next step."""
        need = max(st.seq.prompt_len + st.steps_done + 1 for st in self._slots.values())
        length = next((n for n in self.length_buckets if n >= need), self.capacity)
        return self._bucket(), length, any(st.needs_sort for st in self._slots.values())

    @torch.inference_mode()
    def launch(self) -> PendingStep | None:
        """Run one decode step for every active request (asynchronously on CUDA).

        Requests whose last grid token this step feeds are deactivated (slots freed) right away;
        their entries say ``finished``. Returns None when nothing is active.
        """
        if not self._slots:
            return None
        shape = self._shape()
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

    @staticmethod
    def collect(pending: PendingStep) -> tuple[list[int], list[int]]:
        """Wait for ``pending``'s ids (host sync on its event) and return ``(fed, sampled)`` per slot."""
        if pending.event is not None:
            pending.event.synchronize()
        fed, sampled = pending.ids_host.tolist()
        return fed, sampled

    def _step_impl(
        self, b: int, length: int | None = None, sort: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step over slots ``[0, b)``, attending over the first ``length`` key positions (all by
        default), with the top-k/top-p sorts or not: returns ``(hidden (b, H), fed (b,), sampled (b,))``."""
        length = self.capacity if length is None else length
        active = self.active[:b]
        fed = self.next_token[:b].clone()
        pos = self.cache_pos[:b]
        if self.exact_rows:
            hidden, logits = self._forward_exact(b, fed)
        else:
            hidden = self._forward_batched(b, fed, pos, length)
            logits = F.linear(hidden, self.head_weight).float()
        vis = fed - self.vstart
        in_vis = active & (vis >= 0) & (vis < self.vocab)
        rows = self.rows[:b]
        idx = vis.clamp(0, self.vocab - 1)
        self.seen[rows, idx] = self.seen[rows, idx] | in_vis
        tokens = self._sample(b, logits, sort)
        tokens = tokens[self.source[:b]]
        self.next_token[:b] = torch.where(active, tokens, fed)
        step = active.long()
        self.cache_pos[:b] += step
        self.sample_idx[:b] += step
        return hidden, fed, tokens

    def _forward_batched(self, b: int, fed: torch.Tensor, pos: torch.Tensor, length: int) -> torch.Tensor:
        """All-generation-token decode forward of ``b`` rows, one new position each, attending over
        key positions ``[0, length)`` (every row's ``pos < length``)."""
        cfg = self.model.config
        lm = self.model.language_model
        kern = self._kernels
        if lm.gen_embed_tokens is not None:
            x = lm.gen_embed_tokens(fed - cfg.gen_vocab_start_index)
        else:
            x = lm.embed_tokens(fed)
        rope_pos = (pos + self.rope_off[:b])[:, None]
        cos, sin = lm.rotary_emb(rope_pos, x.dtype)  # (b, 1, head_dim)
        key_start = self.key_start[:b]
        bias = None
        if not self.fused_attention:
            k_idx = self.key_index[:length]
            valid = (k_idx[None, :] >= key_start[:, None]) & (k_idx[None, :] <= pos[:, None])
            # additive float32 bias (0 / -inf), shared by every layer of the step: (b, 1, 1, length)
            bias = torch.zeros(valid.shape, device=x.device, dtype=torch.float32).masked_fill(~valid, float("-inf"))
            bias = bias[:, None, None, :]
        rows = self.rows[:b]
        heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_out = heads * hd
        scale = hd**-0.5
        layers = lm.layers
        first_norm = layers[0].input_layernorm
        h = kern["rms_norm"](x, first_norm.weight, first_norm.variance_epsilon)
        for li, layer in enumerate(layers):
            attn = layer.self_attn
            exp = attn.has_experts
            w_qkv, b_qkv = self._qkv[li]
            q, k, v = kern["rope_qkv"](F.linear(h, w_qkv, b_qkv), cos, sin, heads, kv_heads)
            key_l, value_l = self.pool.key[li], self.pool.value[li]
            if self.fused_attention:
                # Split-KV decode kernel with the KV write fused in (`stage_ar.decode_attention`).
                out = decode_attention(q, k, v, key_l, value_l, pos, key_start, length, scale)
            else:
                key_l[rows, :, pos] = k
                value_l[rows, :, pos] = v
                # Decode attention as two batched GEMMs (the query heads of one KV head are the M
                # rows); scores in the model dtype, softmax in float32 (as transformers' eager
                # attention). cuDNN/flash SDPA here runs one CTA per (row, KV head) over the whole
                # pool width, far below the memory bandwidth (profile in docs/PERFORMANCE.md).
                keys, values = key_l[:b, :, :length], value_l[:b, :, :length]
                qg = q.view(b, kv_heads, heads // kv_heads, hd)
                probs = kern["masked_softmax"](torch.matmul(qg, keys.transpose(-1, -2)), scale, bias)
                out = torch.matmul(probs, values).reshape(b, q_out)
            post = layer.post_attention_layernorm
            x, h = kern["add_rms_norm"](x, (attn.gen_o_proj if exp else attn.o_proj)(out), post.weight,
                                        post.variance_epsilon)
            mlp = layer.gen_mlp if layer.gen_mlp is not None else layer.mlp
            down = mlp.down_proj(kern["silu_mul"](mlp.gate_proj(h), mlp.up_proj(h)))
            norm = layers[li + 1].input_layernorm if li + 1 < len(layers) else lm.norm
            x, h = kern["add_rms_norm"](x, down, norm.weight, norm.variance_epsilon)
        return h

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
            mask = seq._key_mask[:, : length + 1] if seq.cfg else None  # noqa: SLF001
            out = self.model(ids, positions, kv_cache=cache, attention_mask=mask, compute_logits=False)
            last = out.last_hidden_state[:, -1]
            hidden[first : first + n] = last
            logits[first : first + n] = self.model.compute_logits(last)[:, self.vstart : self.vend]
        return hidden, logits

    def _sample(self, b: int, logits: torch.Tensor, sort: bool = True) -> torch.Tensor:
        """Fused grid-constrained sampling of ``b`` rows; same operations as
        `GridConstrainedSampler.sample` (after `T2ISequence`'s CFG mix), batched. ``sort=False``
        skips top-k/top-p (only valid when no row uses them: then both give the same tokens)."""
        partner = self.partner[:b]
        uncond = logits[partner]
        scale = self.cfg_scale[:b, None]
        scores = torch.where(self.has_partner[:b, None], uncond + (logits - uncond) * scale, logits)
        p = self.penalty[:b, None]
        penalised = torch.where(scores < 0, scores * p, scores / p)
        scores = torch.where(self.seen[:b] & (p != 1.0), penalised, scores)
        greedy_idx = torch.argmax(scores, dim=-1)

        s = scores / self.temperature[:b, None]
        if sort:
            desc = torch.sort(s, dim=-1, descending=True).values
            kth = desc.gather(1, (self.top_k[:b] - 1)[:, None])
            s = s.masked_fill(s < kth, float("-inf"))
            asc, order = torch.sort(s, dim=-1, descending=False)
            cumulative = torch.softmax(asc, dim=-1).cumsum(dim=-1)
            remove_sorted = cumulative <= self.top_p_cut[:b, None]
            keep_tail = self.vocab_index >= self.vocab - MIN_TOKENS_TO_KEEP
            remove_sorted = remove_sorted & ~keep_tail[None, :] & self.use_top_p[:b, None]
            remove = remove_sorted.scatter(1, order, remove_sorted)
            s = s.masked_fill(remove, float("-inf"))
        probs = torch.softmax(s, dim=-1, dtype=torch.float64)
        cdf = torch.cumsum(probs, dim=-1)
        sidx = self.sample_idx[:b]
        u = self.uniforms[:b].gather(1, sidx.clamp(max=self.capacity)[:, None]) * cdf[:, -1:]
        index = torch.searchsorted(cdf, u, right=True).clamp(max=self.vocab - 1)
        # never land on a zero-probability entry: step back to the last positive one (as the sampler)
        positive = torch.where(probs > 0, self.vocab_index[None, :], 0)
        index = torch.cummax(positive, dim=-1).values.gather(1, index).squeeze(1)
        index = torch.where(self.greedy[:b], greedy_idx, index)
        width = self.width[:b]
        is_eol = sidx % (width + 1) == width
        return torch.where(is_eol, torch.full_like(index, self.eol), index + self.vstart)

    # ---- bookkeeping for the caller --------------------------------------------------------------

    def entry_sequence(self, key_slot: int) -> T2ISequence | None:
        st = self._slots.get(key_slot)
        return st.seq if st else None
