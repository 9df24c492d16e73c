"""Per-row (per-token) dynamic E4M3 quantization of activations: the pre-pass of `stage_ar.gemv`'s W8A8
mode (``fp8_compute="fp8"``), Triton programs per row and column chunk (CUDA; Triton's interpreter on CPU tensors).

Scheme (the usual per-token one of vLLM and DeepSeek-style W8A8 serving): row ``m``'s scale is
``s[m] = max(amax(|x[m]|) / 448, MIN_ROW_SCALE)`` in float32 and its codes are
``q[m, k] = e4m3(clamp(x[m, k] * r[m], -448, 448))`` with ``r[m] = 1 / s[m]`` (round to nearest
even; both divisions, ``amax / 448`` and ``1 / s``, IEEE ``div_rn``, once per row: the per-value
work is one multiplication, which the W8A8 GEMV's prologue repeats on every activation tile), so ``x[m, k] ≈ q[m, k] * s[m]`` within E4M3's rounding: at most 2^-4 of the magnitude for
values above ``2^-6 * s[m]``, at most ``2^-10 * s[m]`` below. An all-zero row gets
``MIN_ROW_SCALE`` and zero codes (no NaN). A row's scale and codes are computed from that row alone,
by its own programs, so they are the same bits alone and inside any batch. Torch reference:
`stage_ar.gemv_reference.quantize_rows_reference`.

One scale per row, not per group of columns: a grouped form (one scale per 64 columns, written by
the producing GEMV's epilogue, so that no launch of its own computes a whole-row amax or sum of
squares) was built and measured slower on the H200 (2026-12-07): its consumer scales each 64-column
dot before accumulating, which serialises the tensor-core pipeline (qkv 13.9 against 7.4 us, down
64.4 against 19.7 us; the W8A8 step 4.44 against 2.43 ms), and removed (docs/PERFORMANCE.md, issue
17's eighteenth session).
"""

from __future__ import annotations

import dataclasses

import torch

from stage_ar.fp8 import FP8_DTYPE, FP8_MAX
from stage_ar.gemv_checks import ACTIVATION_DTYPES, expect_tensor
from stage_ar.launch_overlap import INTERPRETED, launch_options, pdl_flag
from stage_ar.row_norm import NORM_BLOCK

try:  # triton ships with CUDA builds of torch; CPU-only installs do not have it
    import triton
    import triton.language as tl

    from stage_ar.launch_overlap import wait_for_predecessor
    from stage_ar.row_norm import add_squares, inv_rms_of, norm_values, normalized, row_inv_rms, row_values
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

#: Floor of a row scale (an all-zero row's scale): ``1 / (448 * 512)``.
MIN_ROW_SCALE = 1.0 / (FP8_MAX * 512.0)
#: Columns of codes per program (a row's programs each load the whole row for its amax, then write
#: their chunk: one load round trip instead of a serial loop; H200, 2026-12-03: the single-program
#: loop took 6.2 us per call at K = 3,584, 0.70 ms of a W8A8 step's 3.54).
QUANT_BLOCK = 1024
#: Whether the normalising quantizer takes its one-pass form where a row fits four norm chunks
#: (`_quantize_rows_kernel`'s ``ONE_PASS``: the hidden size's 3,584 columns). Same bits either way.
ONE_PASS_NORM = True
#: Widest row `quantize_rows` takes (the whole row is held in registers for its amax): 2^16 columns.
MAX_COLUMNS = 65536
#: Delayed activation scales (`DelayedRows`, opt-in, an experiment of issue 17): a row is quantized with
#: ``row_scale(DELAYED_MARGIN * a)``, ``a`` the amax the same row had at the same point one decode step
#: earlier, so a row may grow by this factor in one step before its largest values saturate at +-448.
#: A power of two (the product is exact). E4M3 is a float format: the headroom costs no mantissa bits,
#: only two binades at the bottom of the range (values under ``2^-8`` of the row's amax become subnormal).
DELAYED_MARGIN = 4.0
#: Quantization points of a decoder layer with delayed scales, in a layer's `delayed_state` in this order:
#: the attention output (o_proj's input), the post-attention norm's rows (gate_up's), the SwiGLU output
#: (down_proj's), the next layer's input norm rows (its qkv's).
DELAYED_POINTS = ("o_input", "gate_up_input", "down_input", "qkv_input")
#: Columns per partial sum of squares a producer writes for its consumer's RMSNorm (`DelayedOut` with a
#: norm weight): the narrowest columns any W8A8 program owns (a paired program's 64-row tile).
NORM_GROUP = 32

if triton is not None:
    #: Whether kernels round to E4M3 with the GPU's conversion (`quantize_values`): not under Triton's
    #: interpreter, whose direct cast rounds wrongly where the mantissa carries (126.7 -> 64).
    _HARDWARE_E4M3 = tl.constexpr(not INTERPRETED)

    @triton.jit
    def _round_e4m3(v):
        """float32 ``v`` in [-448, 448] rounded to nearest even on E4M3's grid (exactly representable,
        so the cast after it is exact): step ``2^(e - 3)`` for ``|v|`` in ``[2^e, 2^(e+1))``, ``2^-9`` below
        ``2^-6`` (subnormals). Done in float32 because Triton's interpreter rounds the direct cast
        wrongly where the mantissa carries into the exponent (126.7 -> 64); the GPU's cast does not."""
        bits = v.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
        inv_step = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
        t = tl.abs(v) * inv_step  # exact, t <= 16
        r = ((t + 12582912.0) - 12582912.0) * step  # 1.5 * 2^23: float32 addition rounds t to even
        return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # v's sign (-0 too)

    @triton.jit
    def row_scale(amax, min_scale, FP8_MAX_: tl.constexpr):
        """A row's scale from its float32 ``amax``: ``max(amax / FP8_MAX_, min_scale)``, the division IEEE."""
        return tl.maximum(tl.math.div_rn(amax, FP8_MAX_), min_scale)

    @triton.jit
    def inverse_scale(scale):
        """``1 / scale`` (float32, IEEE ``div_rn``): what `quantize_values` multiplies a row's values by."""
        return tl.math.div_rn(1.0, scale)

    @triton.jit
    def quantize_values(v, inv_scale, FP8_MAX_: tl.constexpr):
        """E4M3 codes of float32 values ``v`` times their row's `inverse_scale` ``inv_scale`` (broadcast
        to ``v``): ``e4m3(clamp(v * inv_scale, -FP8_MAX_, FP8_MAX_))``, rounded to nearest even: by the
        GPU's conversion (``cvt.rn.satfinite``, one instruction per two values), or under the
        interpreter by `_round_e4m3` first (same bits; about 15 instructions more per value)."""
        q = tl.minimum(tl.maximum(v * inv_scale, -FP8_MAX_), FP8_MAX_)
        if not _HARDWARE_E4M3:
            q = _round_e4m3(q)
        return q.to(tl.float8e4nv)

    @triton.jit
    def delayed_row_scale(state_ptr, offs_m, m_mask, min_scale, FP8_MAX_: tl.constexpr, MARGIN: tl.constexpr):
        """The ``(16,)`` row scales of a point with delayed scales: ``row_scale(MARGIN * a[m])``, ``a`` the
        float32 amax (int32 bits) the point's state holds at ``state_ptr`` (its first 16 entries: what
        the rows had one step earlier; `FRESH` or 0 give ``min_scale``). ``offs_m`` may be one row."""
        a = tl.load(state_ptr + offs_m, mask=m_mask, other=0).to(tl.float32, bitcast=True)
        return row_scale(a * MARGIN, min_scale, FP8_MAX_)

    @triton.jit
    def _chunk(c, a0, a1, a2, a3):
        """``a{c}`` of a row's four `one_pass_norm` chunks (``c`` in 0..3)."""
        return tl.where(c == 0, a0, tl.where(c == 1, a1, tl.where(c == 2, a2, a3)))

    @triton.jit
    def one_pass_norm(x_ptr, r_ptr, w_ptr, K, eps, NORM_BLOCK_: tl.constexpr, LOG2_NORM_BLOCK: tl.constexpr,
                      RESIDUAL: tl.constexpr):
        """A row of ``K <= 4 * NORM_BLOCK_`` columns loaded once as four ``(NORM_BLOCK_,)`` chunks (its
        values ``v``, `row_values`: plus the residual row at ``r_ptr`` with ``RESIDUAL``), and its Qwen2 RMSNorm with the weight at ``w_ptr`` (`add_squares`, `inv_rms_of`,
        `normalized`: `rms_norm_rows`' bits). Returns ``v0..v3`` (the row's dtype, 0 past K), the
        normalised ``n0..n3`` (float32) and their amax (float32)."""
        lane = tl.arange(0, NORM_BLOCK_)
        v0 = row_values(x_ptr, r_ptr, lane, K, RESIDUAL)
        v1 = row_values(x_ptr, r_ptr, NORM_BLOCK_ + lane, K, RESIDUAL)
        v2 = row_values(x_ptr, r_ptr, 2 * NORM_BLOCK_ + lane, K, RESIDUAL)
        v3 = row_values(x_ptr, r_ptr, 3 * NORM_BLOCK_ + lane, K, RESIDUAL)
        w0 = tl.load(w_ptr + lane, mask=lane < K, other=0.0)
        w1 = tl.load(w_ptr + NORM_BLOCK_ + lane, mask=NORM_BLOCK_ + lane < K, other=0.0)
        w2 = tl.load(w_ptr + 2 * NORM_BLOCK_ + lane, mask=2 * NORM_BLOCK_ + lane < K, other=0.0)
        w3 = tl.load(w_ptr + 3 * NORM_BLOCK_ + lane, mask=3 * NORM_BLOCK_ + lane < K, other=0.0)
        sq = add_squares(tl.zeros((NORM_BLOCK_,), tl.float32), v0.to(tl.float32), v1.to(tl.float32),
                         v2.to(tl.float32), v3.to(tl.float32))
        inv = inv_rms_of(sq, K, eps, LOG2_NORM_BLOCK)
        n0 = normalized(v0, w0, inv).to(tl.float32)
        n1 = normalized(v1, w1, inv).to(tl.float32)
        n2 = normalized(v2, w2, inv).to(tl.float32)
        n3 = normalized(v3, w3, inv).to(tl.float32)
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(n0), axis=0), tl.max(tl.abs(n1), axis=0)),
                          tl.maximum(tl.max(tl.abs(n2), axis=0), tl.max(tl.abs(n3), axis=0)))
        return v0, v1, v2, v3, n0, n1, n2, n3, amax

    @triton.jit
    def _quantize_rows_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, sum_ptr, K, stride_xm, stride_rm, stride_qm,
                              stride_sm, min_scale, eps, FP8_MAX_: tl.constexpr, ROW_BLOCK: tl.constexpr,
                              CHUNK: tl.constexpr, NORM: tl.constexpr = False, RESIDUAL: tl.constexpr = False,
                              NORM_BLOCK_: tl.constexpr = 1024, LOG2_NORM_BLOCK: tl.constexpr = 10,
                              PDL: tl.constexpr = False, ONE_PASS: tl.constexpr = False):
        """Row ``program_id(0)``, codes of columns ``[program_id(1) * CHUNK, +CHUNK)``: the whole row in
        one load (``ROW_BLOCK >= K``) for ``amax`` (max is exact in any order, so every program of the
        row gets the same scale), then this program's chunk of codes; the row's first program stores
        the scale (``FP8_MAX_``: `stage_ar.fp8.FP8_MAX`, E4M3's largest finite value). ``RESIDUAL``:
        the row is first ``round(x + r)`` (`stage_ar.row_norm.row_values`), whose chunk each program
        also stores at ``sum_ptr`` (the new residual stream). ``NORM``: the row is then RMS-normalised
        with ``w_ptr`` and ``eps`` exactly as `stage_ar.row_norm.rms_norm_rows` (its `row_inv_rms` and
        `norm_values`, chunks of ``NORM_BLOCK_``), so the codes and scale are the bits of those
        launches followed by this one. ``ONE_PASS`` (with ``NORM``, ``K <= 4 * NORM_BLOCK_`` and ``CHUNK ==
        NORM_BLOCK_``): the row, its residual and the norm weight are loaded once, as four
        ``NORM_BLOCK_`` chunks held in registers, and the sum of squares, the normalised values, the
        amax, this program's codes and its chunk of the sum all come from them (`add_squares`,
        `inv_rms_of`, `normalized`: the same expressions, so the same bits) instead of three rounds of
        loads. ``PDL``: `stage_ar.launch_overlap`."""
        wait_for_predecessor(PDL)
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        x_ptr += row * stride_xm
        r_ptr += row * stride_rm
        q_ptr += row * stride_qm
        offs = tl.arange(0, ROW_BLOCK)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        if ONE_PASS:
            v0, v1, v2, v3, n0, n1, n2, n3, amax = one_pass_norm(x_ptr, r_ptr, w_ptr, K, eps, NORM_BLOCK_,
                                                                 LOG2_NORM_BLOCK, RESIDUAL)
            xc = _chunk(chunk, n0, n1, n2, n3)
            if RESIDUAL:
                vc = _chunk(chunk, v0, v1, v2, v3)
                tl.store(sum_ptr + row * stride_sm + cols, vc, mask=cols < K)
        else:
            if RESIDUAL:
                tl.store(sum_ptr + row * stride_sm + cols, row_values(x_ptr, r_ptr, cols, K, True), mask=cols < K)
            if NORM:
                inv = row_inv_rms(x_ptr, r_ptr, K, eps, NORM_BLOCK_, LOG2_NORM_BLOCK, RESIDUAL)
                x = norm_values(x_ptr, r_ptr, w_ptr, offs, K, inv, RESIDUAL).to(tl.float32)
                xc = norm_values(x_ptr, r_ptr, w_ptr, cols, K, inv, RESIDUAL).to(tl.float32)
            else:
                x = row_values(x_ptr, r_ptr, offs, K, RESIDUAL).to(tl.float32)
                xc = row_values(x_ptr, r_ptr, cols, K, RESIDUAL).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=0)
        scale = row_scale(amax, min_scale, FP8_MAX_)
        tl.store(q_ptr + cols, quantize_values(xc, inverse_scale(scale), FP8_MAX_), mask=cols < K)
        if chunk == 0:
            tl.store(s_ptr + row, scale)


@dataclasses.dataclass(frozen=True)
class QuantizedRows:
    """Activation rows already quantized by `quantize_rows`, handed to a W8A8 `stage_ar.gemv.gemv`
    in place of the rows (the quantization, with the norm and residual add before it, done in the
    launch that produced them: `stage_ar.linear.GemvLinear.norm_input`).

    Attributes:
        codes: ``(M, K)`` ``torch.float8_e4m3fn``, rows contiguous.
        scales: ``(M,)`` float32 row scales (``rows ≈ codes.float() * scales[:, None]``).
        dtype: the activation dtype the rows stand for (the linear's output dtype).
        shape: the rows' logical shape ``(..., K)`` (leading dims multiply to M).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype
    shape: torch.Size

    def dequantize(self) -> torch.Tensor:
        """``codes * scales`` in float32, viewed as `shape`: the activations W8A8 multiplies."""
        return (self.codes.float() * self.scales[:, None]).view(self.shape)


@dataclasses.dataclass(frozen=True)
class RowsWithAmax:
    """Activation rows whose per-row largest magnitude the launch that wrote them gathered
    (`stage_ar.gemv.gemv`'s ``amax_out``), for a W8A8 `stage_ar.gemv.gemv` that quantizes them in its
    prologue (this module's scheme, the same codes and scales as `quantize_rows`) instead of a
    `quantize_rows` launch between the two. Make the buffers with `amax_buffers`.

    Attributes:
        values: ``(M, K)`` rows in the activation dtype, contiguous rows, ``M <= 16``.
        amax: ``(16,)`` int32, row ``m``'s ``amax(|values[m]|)`` as float32 bits (zero before the
            producer; the consumer launch sets it back to zero).
        counter: ``(1,)`` int32 arrival counter of the consumer's programs (zero between launches).
    """

    values: torch.Tensor
    amax: torch.Tensor
    counter: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """The rows' shape ``(M, K)``."""
        return self.values.shape


def amax_buffers(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(amax, counter)`` pair of `RowsWithAmax` for the W8A8 launch over ``weight`` that reads
    them: ``(16,)`` and ``(1,)`` int32 zeros, one pair per weight kept for the process
    (`stage_ar.arrival.persistent_buffers`, so a captured CUDA graph keeps valid addresses)."""
    from stage_ar.arrival import persistent_buffers

    floats, counters = persistent_buffers(weight, "w8a8_amax", 16, 1)
    return floats[:16].view(torch.int32), counters[:1]


@dataclasses.dataclass(frozen=True)
class DelayedOut:
    """What a W8A8 `stage_ar.gemv.gemv` (the producer) also writes for the W8A8 GEMV that reads its output
    (the consumer) under delayed activation scales (opt-in experiment, issue 17): the output rows as E4M3
    codes, each row quantized in the epilogue with the scale its amax at this point one step earlier
    gives (`DELAYED_MARGIN`), so no launch of its own computes a whole-row amax; the row's amax now is
    max-ed into the point's state for the next step. With ``norm_weight`` (an RMSNorm between the two:
    o_proj and down_proj, whose output plus the residual is the residual stream) the codes are of
    ``round(y + residual) * norm_weight`` and the producer also writes each row's sums of squares per
    `NORM_GROUP` columns; the consumer applies the inverse RMS in its epilogue (a row scale: the codes
    of a per-row scheme do not depend on it).

    Attributes:
        state: ``(len(DELAYED_POINTS) * 32,)`` int32, the layer's `delayed_state`.
        point: index into `DELAYED_POINTS`.
        norm_weight: ``(N,)`` in the activation dtype, or None.
        norm_eps: the norm's epsilon.
    """

    state: torch.Tensor
    point: int
    norm_weight: torch.Tensor | None = None
    norm_eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class DelayedRows:
    """Rows a producer quantized with a delayed scale (`DelayedOut`), for the consumer W8A8 `stage_ar.gemv.gemv`.

    Attributes:
        codes: ``(M, K)`` ``torch.float8_e4m3fn``, rows contiguous.
        state: the layer's `delayed_state`; the point's first 16 entries hold the amax the scale came from.
        point: index into `DELAYED_POINTS`.
        partials: ``(16, cdiv(K, NORM_GROUP))`` float32 sums of squares of the rows before the norm
            weight, or None (no norm between producer and consumer).
        values: ``(M, K)`` the rows the codes stand for (before the norm weight), in ``dtype``: a fresh
            row (`mark_fresh`) is quantized from them by the consumer.
        norm_weight: ``(K,)`` the norm weight in the codes, or None.
        norm_eps: the norm's epsilon (with ``partials``).
        dtype: the activation dtype the rows stand for.
        view_shape: the rows' logical shape ``(..., K)`` (leading dims multiply to M), or None: ``(M, K)``.
    """

    codes: torch.Tensor
    state: torch.Tensor
    point: int
    partials: torch.Tensor | None
    norm_eps: float
    dtype: torch.dtype
    values: torch.Tensor | None = None
    norm_weight: torch.Tensor | None = None
    view_shape: torch.Size | None = None

    @property
    def shape(self) -> torch.Size:
        """The rows' logical shape (`view_shape`, else the codes' ``(M, K)``)."""
        return self.view_shape if self.view_shape is not None else self.codes.shape


#: Most layer states `delayed_state` hands out per device (each 512 bytes, in one pool tensor).
MAX_DELAYED_STATES = 4096
#: A row's amax in a state before its first step (-1.0 as float32 bits): the row is "fresh", and its
#: consumers quantize it from its values with this step's gathered amax (`mark_fresh`).
FRESH = -1.0
_FRESH_BITS = -1082130432  # FRESH's float32 bits as an int32
_delayed_pools: dict = {}


def delayed_state(owner: torch.Tensor) -> torch.Tensor:
    """A decoder layer's delayed-scale state, ``(len(DELAYED_POINTS) * 32,)`` int32: for each point, 16
    rows' amax (float32 bits) that this step's scales come from, then 16 gathered this step. Every row
    `FRESH` when made (`mark_fresh`). Kept for the process per ``owner`` (a weight of the layer; CUDA graphs keep
    the address), in one pool per device so that `mark_fresh` is one operation. A launch with ``roll=``
    this state moves each row's gathered amax, where it is positive, to the first half and zeroes the
    second (`stage_ar.gemv.gemv`), once per step, after every point's consumer has read it.

    Raises:
        RuntimeError: more than `MAX_DELAYED_STATES` owners on the device (a leak, not a model).
    """
    per = len(DELAYED_POINTS) * 32
    pool, index = _delayed_pools.get(owner.device, (None, None))
    if pool is None:
        pool = torch.zeros(MAX_DELAYED_STATES * per, dtype=torch.int32, device=owner.device)
        pool.view(MAX_DELAYED_STATES, len(DELAYED_POINTS), 2, 16)[:, :, 0] = _FRESH_BITS  # every row fresh
        pool, index = _delayed_pools[owner.device] = (pool, {})
    key = (owner.data_ptr(), tuple(owner.shape), owner.dtype)
    if key not in index:
        if len(index) >= MAX_DELAYED_STATES:
            raise RuntimeError(f"delayed-scale states for more than {MAX_DELAYED_STATES} layers: a leak, not a model")
        index[key] = len(index)
    return pool[index[key] * per:(index[key] + 1) * per]


def mark_fresh(rows: slice, device: torch.device) -> None:
    """Rows ``rows`` (pool slots) start a new request: in every layer state on ``device``, each point's
    amax of those rows becomes `FRESH` and their gathered amax zero. A fresh row's consumers quantize it
    from its values with the amax its producer gathers in that step (per-row W8A8's scale), so its first
    step does not depend on the slot's previous request; the step's roll then keeps that amax for the
    next (a roll never replaces an amax with a gathered zero, so a row nothing was gathered for, an
    idle slot, stays fresh, and a fresh row whose gathered amax is zero has only zero codes: consumers
    take the fresh loop only for rows with a positive amax). A no-op before any state exists (they are
    made fresh)."""
    pool, index = _delayed_pools.get(torch.device(device), (None, None))
    if pool is None or not index:
        return
    states = pool[:len(index) * len(DELAYED_POINTS) * 32].view(len(index), len(DELAYED_POINTS), 2, 16)
    states[:, :, 0, rows] = _FRESH_BITS
    states[:, :, 1, rows] = 0


def quantize_rows(x: torch.Tensor, norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                  residual: torch.Tensor | None = None):
    """E4M3 codes and one float32 scale per row of ``x`` (the module's scheme): one launch, programs per
    row and `QUANT_BLOCK` columns. With ``residual``, of ``round(x + residual)`` instead (that sum
    also returned: the new residual stream), and with ``norm_weight`` of the rows' Qwen2 RMSNorm
    (after the add), in the same launch and with the same bits as ``x + residual`` in torch, then
    `stage_ar.row_norm.rms_norm_rows`, then this call (the W8A8 GEMV's norm: one or two launches
    less per normalised projection).

    Args:
        x: ``(M, K)`` activations, bfloat16/float16/float32, rows contiguous, on CUDA (or any
            device under ``TRITON_INTERPRET=1``).
        norm_weight: ``(K,)`` in ``x.dtype``, or None (no norm).
        norm_eps: the norm's epsilon (added to the mean square).
        residual: ``(M, K)`` in ``x.dtype`` with contiguous rows, or None (no add).

    Returns:
        ``(codes, scales)``: ``codes (M, K)`` ``torch.float8_e4m3fn`` (contiguous) and ``scales (M,)``
        float32, on ``x``'s device, with ``x ≈ codes.float() * scales[:, None]`` (``x`` plus the
        residual, normalised with ``norm_weight``, where given). With ``residual``, ``(codes, scales,
        summed)``, ``summed (M, K)`` ``round(x + residual)`` in ``x.dtype``, contiguous.

    Raises:
        ValueError: ``x`` or ``residual`` is not 2-D with contiguous rows, they differ in shape, or
            ``x`` has more than `MAX_COLUMNS` columns.
        TypeError: ``x`` is not bfloat16, float16 or float32; ``residual`` or ``norm_weight`` not in
            its dtype.
        RuntimeError: triton cannot run on ``x``'s device.
    """
    from stage_ar.gemv import available  # the one availability rule (CUDA, or the interpreter)

    if x.ndim != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows takes a 2-D x with contiguous rows, got shape {tuple(x.shape)}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"quantize_rows takes {ACTIVATION_DTYPES} activations, got {x.dtype}")
    if norm_weight is not None:
        expect_tensor("norm_weight", norm_weight, (x.shape[1],), x.dtype, x.device)
    if residual is not None:
        expect_tensor("residual", residual, tuple(x.shape), x.dtype, x.device)
        if residual.stride(1) != 1:
            raise ValueError("quantize_rows takes residual rows contiguous (residual.stride(1) == 1)")
    if not available(x.device):
        raise RuntimeError(f"quantize_rows needs triton and a CUDA device (or TRITON_INTERPRET=1), got {x.device}")
    codes = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    m, k = x.shape
    if k > MAX_COLUMNS:
        raise ValueError(f"quantize_rows takes rows of at most {MAX_COLUMNS} columns, got {k}")
    if m and k:
        pdl = pdl_flag(x.device)
        row_block = max(QUANT_BLOCK, triton.next_power_of_2(k))
        norm = norm_weight is not None
        r = residual if residual is not None else x
        _quantize_rows_kernel[(m, triton.cdiv(k, QUANT_BLOCK))](
            x, r, norm_weight if norm else x, codes, scales, summed if summed is not None else x, k, x.stride(0),
            r.stride(0), codes.stride(0), k, MIN_ROW_SCALE, float(norm_eps), FP8_MAX_=FP8_MAX, ROW_BLOCK=row_block,
            CHUNK=QUANT_BLOCK, NORM=norm, RESIDUAL=summed is not None, NORM_BLOCK_=NORM_BLOCK,
            LOG2_NORM_BLOCK=NORM_BLOCK.bit_length() - 1, num_warps=min(16, max(4, row_block // 2048)), PDL=pdl,
            ONE_PASS=ONE_PASS_NORM and norm and k <= 4 * NORM_BLOCK and QUANT_BLOCK == NORM_BLOCK,
            **launch_options(pdl))
    elif m:
        scales.fill_(MIN_ROW_SCALE)
        if summed is not None:
            summed.copy_(x + residual)
    return (codes, scales) if summed is None else (codes, scales, summed)
