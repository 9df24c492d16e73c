"""Weight-streaming GEMV-class kernels for AR decode: ``out = epilogue(prologue(x) @ weight.T)`` for
at most 16 activation rows (CUDA, Triton; Triton's interpreter on CPU tensors).

At decode, a projection reads its whole weight for a handful of rows: it is a weight stream, and its
time is bytes / bandwidth. Each program owns `BLOCK_N` output columns and walks K in tiles of
`BLOCK_K` (all of K, or with split-K one of `split_k_for`'s K ranges: FP8 weights on narrow shapes,
whose partials the last of the column block's programs adds in range order, in the same launch, so
there is no reduce pass and the sum's order is fixed); one ``tl.dot`` per tile
with the weight tile as the left operand (``(BLOCK_N, BLOCK_K)`` straight from the row-major
``nn.Linear`` layout) and the activations, padded to 16 rows, as the right one, accumulated in
float32. Variants are compile-time flags, so each layer's projection is one launch:

- RMSNorm (``norm_weight``): the model's Qwen2 RMSNorm numerics,
  ``round(norm_weight * round(x * rsqrt(mean(x²) + eps)))`` with the statistics in float32 and
  ``round`` the cast to the activation dtype. By default `rms_norm_rows` (one small program per
  row, a second launch) writes the normalised rows first; ``norm_in_prologue`` instead has every
  GEMV program normalise every activation tile itself after a first pass for the inverse RMS. On
  the H200 (2026-12-01, `benchmarks/gemv.py`) that redundant work cost more than the launch it
  saves (gate_up 81 us vs 65 us without the norm), hence the default.
- epilogues: FP8 scale (``weight_scale``), ``bias``, then either ``swiglu`` (the weight is
  ``(2 * N, K)``, gate rows then up rows, as vLLM's merged gate/up; ``out = silu(gate) * up``) and/or
  a ``residual`` add, or RoPE (``cos``/``sin``: a fused qkv's q and k heads rotated, rotate-half
  layout, column ``c`` paired with ``c + head_dim / 2``). A paired program (SwiGLU's gate and up
  rows, RoPE's column pairs) owns ``BLOCK_N / 2`` pairs and streams one ``BLOCK_N``-row weight tile
  holding their first rows, then their partners': the loads and dots of a plain launch, the
  accumulator split into its halves for the epilogue (before 2026-12-03 it streamed two
  ``BLOCK_N``-row tiles into two accumulators, and the H200 measured that form slower than the
  plain launch of the same bytes: bf16 gate_up 75.7 vs 64.9 us, docs/PERFORMANCE.md). Each step rounds to the activation dtype where the eager module chain
  does (linear output, SiLU, product, sum; RoPE's two products and their sum), so the fused kernel
  differs from eager only by the dot's summation order (`stage_ar.gemv_reference` is that chain).
- W8A16 (``weight`` in ``float8_e4m3fn`` with ``weight_scale (N,)`` float32, `stage_ar.fp8`):
  codes widened in registers (to float16 by default, activations too: ``fp8_compute``), scale
  applied once per output; FP8 launches autotune over `FP8_TUNED_CONFIGS`. W8A8 (opt-in,
  ``fp8_compute="fp8"``, its own candidates `W8A8_TUNED_CONFIGS`): rows quantized per token first, FP8 x FP8 dots, both scales in the epilogue.

Batch invariance by construction: the activations are always one 16-row tile (rows past M load as
zeros), so M picks no kernel, config or code path; a row's arithmetic is its own dot products,
taken in K-tile order with a fixed `BLOCK_K` (`block_k_for`) and split count (`split_k_for`, a
function of the shape), and its inverse RMS
summed elementwise per chunk and then by a fixed pairwise tree (never a layout-dependent
``tl.sum``), in a program of its own row (`rms_norm_rows`) or of every GEMV program alike.
Autotuning (keyed on N, K, the flags and the dtypes, **not on M**) chooses only `BLOCK_N`, warps
and stages. Those place the work, but on the H200 they can also change the instructions a dot
lowers to, and with them a row's bits: with the key once including the M bucket, the engine's
bucket mode (batch 1, 2, 4, 8 GEMV calls) gave a request different rows alone and inside a batch
(`benchmarks/ar_decode.py` correctness, 2026-12-01). So the first call of a shape, whatever its M,
fixes the configuration for every M, and a row gives the same bits alone, inside any batch of up to
16 and in every step of a process.

Autotuning launches and synchronises on the first call of each key: call every shape and variant
once before capturing CUDA graphs (the runner's capture warm-up does, at its smallest batch first).
A variant the GPU's pinned picks name (`pinned_picks`: ``MAMMOTH_GEMV_PICKS`` or the file shipped in
``stage_ar/gemv_picks/``) launches with its pick instead, untimed, the same in every process.
"""

from __future__ import annotations


import dataclasses
import logging
import os

import torch

from stage_ar.arrival import persistent_buffers
from stage_ar.gemv_configs import (  # noqa: F401 - re-exported: the launch parameters live there
    PICKS_ENV, TUNING_KEY, load_picks, pick_key, shipped_picks_path,
    FP8_DTYPE, FP8_TUNED_CONFIGS, INTERPRETER_CONFIG, TUNED_CONFIGS, W8A8_TUNED_CONFIGS, GemvConfig, block_k_for,
    fits_shared_memory, split_k_for, tuned_configs,
)
from stage_ar.gemv_checks import (  # noqa: F401 - re-exported
    ACTIVATION_DTYPES, FP8_COMPUTES, MAX_ROWS, check_fp8_compute, check_gemv_args, expect_tensor,
)
from stage_ar.fp8 import FP8_MAX
from stage_ar.fp8_activations import (
    DELAYED_MARGIN, DELAYED_POINTS, MIN_ROW_SCALE, NORM_GROUP, DelayedOut, DelayedRows, QuantizedRows, RowsWithAmax,
    quantize_rows,
)
from stage_ar.row_norm import rms_norm_rows
from stage_ar.launch_overlap import (  # noqa: F401 - INTERPRETED re-exported
    INTERPRETED, launch_options, pdl_flag, preload_tiles,
)

try:  # triton ships with CUDA builds of torch; CPU-only installs do not have it
    import triton
    import triton.language as tl

    from stage_ar.arrival import last_arrival, reset_arrivals
    from stage_ar.fp8_activations import delayed_row_scale, inverse_scale, quantize_values, row_scale
    from stage_ar.launch_overlap import wait_for_predecessor
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None
#: The kernel's ``FP8_MODE`` for each of `FP8_COMPUTES` (`gemv`'s ``fp8_compute``).
_FP8_MODES = {"activation": 0, "float16": 1, "float16_bits": 2, "fp8": 3}
#: float16's largest finite magnitude: float16-compute activations saturate there.
F16_MAX = 65504.0


logger = logging.getLogger(__name__)

#: ``[warm-up, repetitions]`` in ms of each candidate's timing (Triton's ``do_bench``);
#: `benchmarks/gemv_pick.py` raises them to choose the picks it pins.
TUNING_MS = [5, 20]


def available(device: torch.device) -> bool:
    """True when the kernels can run on ``device``: CUDA with triton, or any device under the interpreter."""
    return triton is not None and (device.type == "cuda" or INTERPRETED)


if triton is not None:
    #: E4M3's largest finite value (`stage_ar.fp8.FP8_MAX`) as the kernels' compile-time constant.
    E4M3_MAX = tl.constexpr(FP8_MAX)
    #: `stage_ar.fp8_activations`' delayed-scale constants as compile-time ones.
    DELAYED_MARGIN_ = tl.constexpr(DELAYED_MARGIN)
    NORM_GROUP_ = tl.constexpr(NORM_GROUP)
    LOG2_NORM_GROUP = tl.constexpr(NORM_GROUP.bit_length() - 1)
    DELAYED_STATE_ROWS = tl.constexpr(16 * len(DELAYED_POINTS))

    @triton.jit
    def _squares(x_ptr, stride_xm, offs_m, m_mask, k, K):
        """``x²`` of the ``(16, BLOCK_K)`` activation tile at columns ``k`` (zeros past M and K), float32."""
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                    mask=m_mask[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        return x * x

    @triton.jit
    def _inv_rms(x_ptr, stride_xm, offs_m, m_mask, offs_k, K, eps,
                 BLOCK_K: tl.constexpr, LOG2_BLOCK_K: tl.constexpr):
        """``rsqrt(mean(x²) + eps)`` of each of the 16 rows, float32, in a layout-independent order:
        column ``j`` of the accumulator sums tiles 0, 1, 2, ... in turn, then a fixed pairwise tree
        folds the columns. Four tiles per iteration keep four loads in flight (same order)."""
        sq = tl.zeros((16, BLOCK_K), tl.float32)
        for k0 in range(0, K, 4 * BLOCK_K):
            s0 = _squares(x_ptr, stride_xm, offs_m, m_mask, k0 + offs_k, K)
            s1 = _squares(x_ptr, stride_xm, offs_m, m_mask, k0 + BLOCK_K + offs_k, K)
            s2 = _squares(x_ptr, stride_xm, offs_m, m_mask, k0 + 2 * BLOCK_K + offs_k, K)
            s3 = _squares(x_ptr, stride_xm, offs_m, m_mask, k0 + 3 * BLOCK_K + offs_k, K)
            sq = (((sq + s0) + s1) + s2) + s3
        for _ in tl.static_range(LOG2_BLOCK_K):  # fold halves: the pairs are fixed, so are the bits
            sq = tl.sum(tl.reshape(sq, (16, 2, sq.shape[1] // 2)), axis=1)
        return tl.rsqrt(tl.reshape(sq, (16,)) / K + eps)

    @triton.jit
    def _x_tile(x_ptr, stride_xm, offs_m, m_mask, k, K, norm_ptr, inv_rms,
                NORM: tl.constexpr, EVEN_K: tl.constexpr):
        """The ``(16, BLOCK_K)`` activation tile at columns ``k``, RMS-normalised if ``NORM``."""
        if EVEN_K:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None], other=0.0)
        else:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                        mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
        if NORM:
            if EVEN_K:
                nw = tl.load(norm_ptr + k)
            else:
                nw = tl.load(norm_ptr + k, mask=k < K, other=0.0)
            xn = (x.to(tl.float32) * inv_rms[:, None]).to(x.dtype)
            x = (xn.to(tl.float32) * nw.to(tl.float32)[None, :]).to(x.dtype)
        return x

    @triton.jit
    def _f16_bits(w):
        """E4M3 codes -> float16 ``code * 2^-8`` by integer operations: sign to bit 15, the 7 exponent and
        mantissa bits shifted up by 7 (E4M3's 4-bit exponent, bias 7, lands in float16's 5-bit one,
        bias 15; subnormals map onto subnormals), exact for every finite code."""
        b = w.to(tl.uint8, bitcast=True).to(tl.uint16)
        return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)

    @triton.jit
    def _f16_saturated(x):
        """Activations as float16, clamped to +-65504 (the float16-compute FP8 modes)."""
        return tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    @triton.jit
    def _w_tile(w_ptr, rows, n_mask, k, K, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
        """The ``(BLOCK_N, BLOCK_K)`` tile of the row-major ``(N, K)`` weight at rows ``rows`` and
        columns ``k``, as stored (zeros outside ``n_mask`` and past ``K``; the masks only where the
        ``EVEN_*`` flags say a tile can be partial)."""
        ptrs = w_ptr + rows[:, None] * K + k[None, :]
        if EVEN_K and EVEN_N:
            w = tl.load(ptrs)
        elif EVEN_K:
            w = tl.load(ptrs, mask=n_mask[:, None], other=0.0)
        else:
            w = tl.load(ptrs, mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
        return w

    @triton.jit
    def _w_tile_below(w_ptr, rows, n_mask, k, K, k_end):
        """`_w_tile` masked to the columns below ``k_end`` (<= ``K``, the row stride): a tile loaded
        before the program knows it is in its K range."""
        return tl.load(w_ptr + rows[:, None] * K + k[None, :], mask=n_mask[:, None] & (k < k_end)[None, :], other=0.0)

    @triton.jit
    def _w_dot(w_ptr, rows, n_mask, k, K, x_t, acc, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
               IEEE: tl.constexpr, FP8_MODE: tl.constexpr = 0):
        """``acc + W[rows, k] @ x_t``: the weight tile widened to the activation dtype (``FP8_MODE`` 2:
        E4M3 codes to float16 ``code * 2^-8`` by `_f16_bits`, the epilogue scales by 2^8)."""
        return _tile_dot(_w_tile(w_ptr, rows, n_mask, k, K, EVEN_K, EVEN_N), x_t, acc, IEEE, FP8_MODE)

    @triton.jit
    def _tile_dot(w, x_t, acc, IEEE: tl.constexpr, FP8_MODE: tl.constexpr):
        """``acc + w @ x_t`` for a weight tile ``w`` as stored (see `_w_dot`)."""
        if FP8_MODE == 2:
            w = _f16_bits(w)
        else:
            w = w.to(x_t.dtype)
        if IEEE:
            acc = tl.dot(w, x_t, acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x_t, acc)
        return acc

    @triton.jit
    def _scaled(acc, rows, n_mask, scale_ptr, bias_ptr, x_scale, dtype: tl.constexpr,
                FP8: tl.constexpr, HAS_BIAS: tl.constexpr, FP8_MODE: tl.constexpr = 0):
        """The linear output rounded to ``dtype``: ``acc * scale + bias`` in float32 first (``FP8_MODE``
        2: ``scale * 2^8``, exact, undoing `_f16_bits`' factor; 3 and 4, W8A8: ``acc * scale[n] *
        x_scale[m]``, the ``(16,)`` activation row scales)."""
        if FP8:
            scale = tl.load(scale_ptr + rows, mask=n_mask, other=0.0)
            if FP8_MODE == 2:
                scale = scale * 256.0
            acc = acc * scale[:, None]
            if FP8_MODE >= 3:  # W8A8: each activation row's own scale (`stage_ar.fp8_activations`)
                acc = acc * x_scale[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + rows, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        return acc.to(dtype)

    @triton.jit
    def _rope_pair(lo, hi, cos_ptr, sin_ptr, stride_cm, i, half, offs_m, mask, rotate):
        """RoPE of the ``(BLOCK_N, 16)`` column pairs ``c`` (``lo``, at ``i = c % head_dim`` in its head's
        first half) and ``c + half`` (``hi``) in the rotate-half layout, rounded as the eager
        `stage_ar.layers.apply_rope` rounds (each product, then the sum, in the activation dtype):
        ``lo' = lo * cos[i] - hi * sin[i]``, ``hi' = hi * cos[i + half] + lo * sin[i + half]``, per row's
        ``cos``/``sin`` ``(M, head_dim)``; columns where ``rotate`` is False pass through (v heads)."""
        dtype = lo.dtype
        at = offs_m[None, :] * stride_cm + i[:, None]
        live = mask & rotate[:, None]
        cos_lo = tl.load(cos_ptr + at, mask=live, other=0.0).to(tl.float32)
        sin_lo = tl.load(sin_ptr + at, mask=live, other=0.0).to(tl.float32)
        cos_hi = tl.load(cos_ptr + at + half, mask=live, other=0.0).to(tl.float32)
        sin_hi = tl.load(sin_ptr + at + half, mask=live, other=0.0).to(tl.float32)
        lo_f, hi_f = lo.to(tl.float32), hi.to(tl.float32)
        new_lo = ((lo_f * cos_lo).to(dtype).to(tl.float32) + (-hi_f * sin_lo).to(dtype).to(tl.float32)).to(dtype)
        new_hi = ((hi_f * cos_hi).to(dtype).to(tl.float32) + (lo_f * sin_hi).to(dtype).to(tl.float32)).to(dtype)
        return tl.where(rotate[:, None], new_lo, lo), tl.where(rotate[:, None], new_hi, hi)

    @triton.jit
    def _epilogue(acc, offs_n, partner, n_mask, offs_m, m_mask, scale_ptr, bias_ptr, x_scale, res_ptr,
                  cos_ptr, sin_ptr, out_ptr, amax_ptr, stride_rm, stride_cm, stride_om, ROPE_N, FP8: tl.constexpr,
                  HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, FP8_MODE: tl.constexpr,
                  ROPE: tl.constexpr, HEAD_DIM: tl.constexpr, AMAX_OUT: tl.constexpr, pid_n, N, dq_ptr,
                  ds_ptr, dnw_ptr, dpo_ptr, stride_qm, min_scale, QUANT_OUT: tl.constexpr):
        """From a program's ``(BLOCK_N, 16)`` float32 dot sums ``acc`` (paired: its pairs' first rows, then
        their partners', `_split_pairs`) to the stored output: scale and bias, SwiGLU, residual or
        RoPE, each rounded where the eager chain rounds. Rows in ``m_mask`` are stored. ``AMAX_OUT``:
        each row's largest stored magnitude goes into ``amax_ptr`` (int32 float bits, an atomic max:
        exact in any order, so the row's amax does not depend on which program finishes last).
        ``QUANT_OUT`` (`stage_ar.fp8_activations.DelayedOut`): the stored values ``y`` (2: times the norm
        weight at ``dnw_ptr``) also as E4M3 codes at ``dq_ptr``, quantized with the delayed scale of the
        point state at ``ds_ptr`` (`_delayed_out`)."""
        dtype: tl.constexpr = out_ptr.dtype.element_ty
        PAIRED: tl.constexpr = SWIGLU | ROPE
        if PAIRED:
            acc, acc2 = _split_pairs(acc, acc.shape[0] // 2)
        y = _scaled(acc, offs_n, n_mask, scale_ptr, bias_ptr, x_scale, dtype, FP8, HAS_BIAS, FP8_MODE)
        if PAIRED:
            y2 = _scaled(acc2, partner, n_mask, scale_ptr, bias_ptr, x_scale, dtype, FP8, HAS_BIAS, FP8_MODE)
        if SWIGLU:  # silu(gate) * up, each rounded as F.silu and the bf16 product round
            gate = y.to(tl.float32)
            y = ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * y2.to(tl.float32)).to(dtype)
        out_mask = n_mask[:, None] & m_mask[None, :]
        if RESIDUAL:
            res = tl.load(res_ptr + offs_m[None, :] * stride_rm + offs_n[:, None], mask=out_mask, other=0.0)
            y = (y.to(tl.float32) + res.to(tl.float32)).to(dtype)
        if ROPE:
            y, y2 = _rope_pair(y, y2, cos_ptr, sin_ptr, stride_cm, offs_n % HEAD_DIM, HEAD_DIM // 2, offs_m,
                               out_mask, offs_n < ROPE_N)
            tl.store(out_ptr + offs_m[None, :] * stride_om + partner[:, None], y2, mask=out_mask)
        if AMAX_OUT:  # not with ROPE (`gemv` refuses it): y holds every stored value
            row_amax = tl.max(tl.where(out_mask, tl.abs(y.to(tl.float32)), 0.0), axis=0)
            tl.atomic_max(amax_ptr + offs_m, row_amax.to(tl.int32, bitcast=True), mask=m_mask)
        if QUANT_OUT > 0:  # not with ROPE either
            _delayed_out(y, offs_n, n_mask, offs_m, m_mask, out_mask, pid_n, N, dq_ptr, ds_ptr, dnw_ptr, dpo_ptr,
                         stride_qm, min_scale, QUANT_OUT)
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y, mask=out_mask)

    @triton.jit
    def _delayed_out(y, offs_n, n_mask, offs_m, m_mask, out_mask, pid_n, N, dq_ptr, ds_ptr, dnw_ptr, dpo_ptr,
                     stride_qm, min_scale, QUANT_OUT: tl.constexpr):
        """A producer's part of delayed activation scales (`stage_ar.fp8_activations.DelayedOut`) for its
        ``(BLOCK_N, 16)`` stored values ``y``: ``t = y`` (``QUANT_OUT`` 2: ``y * norm_weight[n]``, float32);
        codes ``quantize_values(t, 1 / delayed_row_scale)`` at ``dq_ptr`` (stride ``stride_qm``), each
        row's ``max |t|`` max-ed into the state's second 16 entries, and (2) each row's sums of ``y²``
        per `NORM_GROUP` columns at ``dpo_ptr`` (``(16, cdiv(N, NORM_GROUP))``, a fixed pairwise fold:
        the same bits for any ``BLOCK_N``), for the consumer's inverse RMS."""
        x_inv = inverse_scale(delayed_row_scale(ds_ptr, offs_m, m_mask, min_scale, E4M3_MAX, DELAYED_MARGIN_))
        t = y.to(tl.float32)
        if QUANT_OUT == 2:
            t = t * tl.load(dnw_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            sq = tl.where(out_mask, y.to(tl.float32) * y.to(tl.float32), 0.0)
            GROUPS: tl.constexpr = y.shape[0] // NORM_GROUP_
            sq = tl.reshape(sq, (GROUPS, NORM_GROUP_, 16))
            for _ in tl.static_range(LOG2_NORM_GROUP):  # fold halves: fixed pairs, fixed bits
                sq = tl.sum(tl.reshape(sq, (GROUPS, 2, sq.shape[1] // 2, 16)), axis=1)
            sq = tl.reshape(sq, (GROUPS, 16))
            parts = tl.cdiv(N, NORM_GROUP_)
            g = pid_n * GROUPS + tl.arange(0, GROUPS)
            tl.store(dpo_ptr + offs_m[None, :] * parts + g[:, None], sq, mask=(g < parts)[:, None] & m_mask[None, :])
        codes = quantize_values(t, x_inv[None, :], E4M3_MAX)
        tl.store(dq_ptr + offs_m[None, :] * stride_qm + offs_n[:, None], codes, mask=out_mask)
        row_amax = tl.max(tl.where(out_mask, tl.abs(t), 0.0), axis=0)
        tl.atomic_max(ds_ptr + 16 + offs_m, row_amax.to(tl.int32, bitcast=True), mask=m_mask)

    @triton.jit
    def _k_dots(x_ptr, stride_xm, offs_m, m_mask, offs_k, k_start, k_hi, K, norm_ptr, inv_rms, x_inv, w_ptr, rows,
                row_mask, acc, BLOCK_K: tl.constexpr, NORM: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                IEEE: tl.constexpr, FP8_MODE: tl.constexpr):
        """``acc`` plus the dots of K tiles ``[k_start, k_hi)`` in order (`_x_tile`, `_activation_operand`, `_w_dot`)."""
        for k0 in range(k_start, k_hi, BLOCK_K):
            k = k0 + offs_k
            x_t = tl.trans(_x_tile(x_ptr, stride_xm, offs_m, m_mask, k, K, norm_ptr, inv_rms, NORM, EVEN_K))
            x_t = _activation_operand(x_t, x_inv, FP8_MODE)
            acc = _w_dot(w_ptr, rows, row_mask, k, K, x_t, acc, EVEN_K, EVEN_N, IEEE, FP8_MODE)
        return acc

    @triton.jit
    def _fresh_dots(x_ptr, stride_xm, dv_ptr, stride_vm, dvn_ptr, offs_m, m_mask, fresh, fresh_inv, w_ptr, rows,
                    row_mask, offs_k, k_start, k_hi, K, acc, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                    EVEN_N: tl.constexpr, IEEE: tl.constexpr, X_NORM: tl.constexpr):
        """The K loop of a delayed-scale consumer (``FP8_MODE`` 5) with fresh rows: each activation tile
        is the codes as loaded, except a fresh row's, quantized here from its values (times the norm
        weight with ``X_NORM``) with its inverse scale ``fresh_inv`` (`quantize_values`)."""
        for k0 in range(k_start, k_hi, BLOCK_K):
            k = k0 + offs_k
            codes = _x_tile(x_ptr, stride_xm, offs_m, m_mask, k, K, x_ptr, fresh_inv, False, EVEN_K)
            v = tl.load(dv_ptr + offs_m[:, None] * stride_vm + k[None, :], mask=fresh[:, None] & (k < K)[None, :],
                        other=0.0).to(tl.float32)
            if X_NORM:
                v = v * tl.load(dvn_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
            x = tl.where(fresh[:, None], quantize_values(v, fresh_inv[:, None], E4M3_MAX), codes)
            acc = _w_dot(w_ptr, rows, row_mask, k, K, tl.trans(x), acc, EVEN_K, EVEN_N, IEEE, 5)
        return acc

    @triton.jit
    def _partials_inv_rms(p_ptr, offs_m, m_mask, K, eps, LOG2_PARTS: tl.constexpr):
        """``rsqrt(mean(x²) + eps)`` of the 16 rows from a producer's sums of squares per `NORM_GROUP`
        columns (`_delayed_out`; ``cdiv(K, NORM_GROUP)`` per row, at most ``2^LOG2_PARTS``), added by a
        fixed pairwise tree."""
        PARTS: tl.constexpr = 1 << LOG2_PARTS
        parts = tl.cdiv(K, NORM_GROUP_)
        g = tl.arange(0, PARTS)
        sq = tl.load(p_ptr + offs_m[:, None] * parts + g[None, :], mask=m_mask[:, None] & (g < parts)[None, :],
                     other=0.0)
        for _ in tl.static_range(LOG2_PARTS):
            sq = tl.sum(tl.reshape(sq, (16, 2, sq.shape[1] // 2)), axis=1)
        return tl.rsqrt(tl.reshape(sq, (16,)) / K + eps)

    @triton.jit(do_not_specialize=["M"])
    def _gemv_kernel(
        x_ptr, w_ptr, scale_ptr, bias_ptr, norm_ptr, res_ptr, cos_ptr, sin_ptr, out_ptr, xs_ptr, ws_ptr,
        cnt_ptr, amax_ptr, amax_cnt_ptr, M, N, K, stride_xm, stride_rm, stride_cm, stride_om, eps, min_scale, ROPE_N,
        dq_ptr, ds_ptr, dnw_ptr, dpo_ptr, dpi_ptr, roll_ptr, stride_qm, dv_ptr, dvn_ptr, stride_vm,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOG2_BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr,
        HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, IEEE: tl.constexpr,
        FP8_MODE: tl.constexpr = 0, ROPE: tl.constexpr = False, HEAD_DIM: tl.constexpr = 0,
        SPLIT_K: tl.constexpr = 1, PDL: tl.constexpr = False, PRELOAD: tl.constexpr = 0,
        AMAX_OUT: tl.constexpr = False, QUANT_OUT: tl.constexpr = 0, X_NORM: tl.constexpr = False,
        LOG2_PARTS: tl.constexpr = 0, ROLL: tl.constexpr = False,
    ):
        """Output columns ``[pid * BLOCK_N, +BLOCK_N)`` of ``out (M, N)``. Under SWIGLU (weight rows ``c``,
        gate, and ``N + c``, up, make column ``c``) and ROPE (the pair ``c``, ``c + HEAD_DIM / 2`` of the
        j-th first-half column ``c`` of the heads, both written, the first ``ROPE_N`` columns rotated) a
        program owns ``BLOCK_N / 2`` such pairs, and its one ``(BLOCK_N, BLOCK_K)`` weight tile holds
        their first rows, then their partner rows (`_pair_rows`): the same tile, loads and dot as a
        plain launch of ``BLOCK_N`` columns, split into the two halves for the epilogue
        (`_split_pairs`). The accumulator is ``(BLOCK_N, 16)``: transposed. ``FP8_MODE`` 3 (W8A8):
        ``x_ptr`` holds E4M3 codes, ``xs_ptr`` their row scales, the dots are FP8 x FP8.

        ``SPLIT_K`` > 1: program ``(j, s)`` sums K tiles ``[s * T, (s + 1) * T)`` (``T = cdiv(tiles,
        SPLIT_K)``) into its float32 partials in ``ws_ptr``; the last of a column block's programs to
        arrive (a ticket from the counter at ``cnt_ptr + j``, reset to 0 by that program) adds the
        partials in split order 0, 1, ... (whichever arrives last: fixed bits) and runs the epilogue.

        ``PDL`` (`stage_ar.launch_overlap.pdl_flag`): the program may start while the previous kernel
        finishes and waits for it before its first activation load. ``PRELOAD``
        (`stage_ar.launch_overlap.preload_tiles`, 0 to 3): the range's first ``PRELOAD`` weight tiles
        are loaded before that wait (those past the range masked, and their dots skipped), and
        multiplied first, in order, after it.

        ``FP8_MODE`` 4 (W8A8 on `stage_ar.fp8_activations.RowsWithAmax`): ``x_ptr`` holds the rows in
        the activation dtype and ``amax_ptr`` their amax (int32 float bits); each activation tile is
        quantized as it is loaded (`stage_ar.fp8_activations.quantize_values` over `row_scale`:
        `quantize_rows`' codes and scales), and the last program to finish (a ticket from
        ``amax_cnt_ptr``, then reset) sets the amax back to zero for the next producer. ``AMAX_OUT``:
        the output rows' amax into ``amax_ptr`` (`_epilogue`).

        Delayed activation scales (`stage_ar.fp8_activations.DelayedRows`, opt-in): ``FP8_MODE`` 5 reads
        E4M3 codes as 3 does, with row scales from the point state at ``amax_ptr``
        (`delayed_row_scale`), times each row's inverse RMS from the producer's partial sums of squares
        at ``dpi_ptr`` with ``X_NORM``; a fresh row (its state amax negative:
        `stage_ar.fp8_activations.mark_fresh`) is instead quantized here from its values at ``dv_ptr``
        (times the norm weight at ``dvn_ptr`` with ``X_NORM``) with the amax its producer gathered this
        step (`_fresh_dots`; only launches with a fresh row take that loop). ``QUANT_OUT`` 1 / 2 writes
        such codes for the next GEMV (`_delayed_out`); ``ROLL``: program 0 moves each point's gathered
        amax in the layer state at ``roll_ptr``, where positive, to the half the next step's scales
        read, and zeroes the gathered half."""
        PAIRED: tl.constexpr = SWIGLU | ROPE  # a tile of BLOCK_N / 2 pairs
        pid_n = tl.program_id(0)
        if PAIRED:
            rows, row_mask, offs_n, partner, n_mask = _pair_rows(pid_n, N, BLOCK_N, ROPE, HEAD_DIM)
        else:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            partner = offs_n
            rows = offs_n
            row_mask = n_mask
        offs_m = tl.arange(0, 16)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        if SPLIT_K == 1:
            k_lo = 0
            k_hi = K
        else:
            span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
            k_lo = tl.program_id(1) * span
            k_hi = tl.minimum(K, k_lo + span)
        # PRELOAD: the range's first K tiles' weights load before the wait (no kernel writes weights);
        # their dots come first after the wait, in order, so a row's sums keep their order. A split's
        # range may be empty (k_lo >= K): its first tile is masked to zeros by k < K, as the
        # activations are. Later preloaded tiles past the range (k_hi) are masked, and their dots skipped.
        FIRST_EVEN: tl.constexpr = EVEN_K and SPLIT_K == 1
        if PRELOAD >= 1:
            w_first = _w_tile(w_ptr, rows, row_mask, k_lo + offs_k, K, FIRST_EVEN, EVEN_N)
        if PRELOAD >= 2:
            w_second = _w_tile_below(w_ptr, rows, row_mask, k_lo + BLOCK_K + offs_k, K, k_hi)
        if PRELOAD >= 3:
            w_third = _w_tile_below(w_ptr, rows, row_mask, k_lo + 2 * BLOCK_K + offs_k, K, k_hi)
        wait_for_predecessor(PDL)
        if ROLL:
            if (pid_n == 0) & (tl.program_id(1) == 0):
                i = tl.arange(0, DELAYED_STATE_ROWS)
                gathered = roll_ptr + (i // 16) * 32 + 16 + i % 16
                now = tl.load(gathered)
                kept = roll_ptr + (i // 16) * 32 + i % 16
                tl.store(kept, tl.where(now > 0, now, tl.load(kept)))  # a zero (no row there) keeps FRESH
                tl.store(gathered, tl.zeros((DELAYED_STATE_ROWS,), tl.int32))
        x_scale = tl.zeros((16,), tl.float32)  # W8A8's activation row scales (unused otherwise)
        x_inv = x_scale  # FP8_MODE 4: their inverses, what the prologue multiplies by
        if FP8_MODE == 3:
            x_scale = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
        if FP8_MODE == 4:
            amax = tl.load(amax_ptr + offs_m, mask=m_mask, other=0).to(tl.float32, bitcast=True)
            x_scale = row_scale(amax, min_scale, E4M3_MAX)
            x_inv = inverse_scale(x_scale)
        fresh = m_mask & False
        fresh_scale = x_scale
        if FP8_MODE == 5:
            x_scale = delayed_row_scale(amax_ptr, offs_m, m_mask, min_scale, E4M3_MAX, DELAYED_MARGIN_)
            gathered = tl.load(amax_ptr + 16 + offs_m, mask=m_mask, other=0)
            fresh = m_mask & (tl.load(amax_ptr + offs_m, mask=m_mask, other=0) < 0) & (gathered > 0)
            fresh_scale = row_scale(gathered.to(tl.float32, bitcast=True), min_scale, E4M3_MAX)
            x_scale = tl.where(fresh, fresh_scale, x_scale)
            if X_NORM:
                x_scale = x_scale * _partials_inv_rms(dpi_ptr, offs_m, m_mask, K, eps, LOG2_PARTS)
        inv_rms = tl.zeros((16,), tl.float32)
        if NORM:
            inv_rms = _inv_rms(x_ptr, stride_xm, offs_m, m_mask, offs_k, K, eps, BLOCK_K, LOG2_BLOCK_K)
        acc = tl.zeros((BLOCK_N, 16), tl.float32)
        k_start = k_lo
        if PRELOAD >= 1:
            k = k_lo + offs_k
            x_t = tl.trans(_x_tile(x_ptr, stride_xm, offs_m, m_mask, k, K, norm_ptr, inv_rms, NORM, FIRST_EVEN))
            x_t = _activation_operand(x_t, x_inv, FP8_MODE)
            acc = _tile_dot(w_first, x_t, acc, IEEE, FP8_MODE)
            k_start = k_lo + BLOCK_K
        if PRELOAD >= 2:
            acc = _preloaded_dot(w_second, x_ptr, stride_xm, offs_m, m_mask, k_start, k_hi, K, norm_ptr, inv_rms,
                                 x_inv, acc, BLOCK_K, NORM, EVEN_K, IEEE, FP8_MODE)
            k_start += BLOCK_K
        if PRELOAD >= 3:
            acc = _preloaded_dot(w_third, x_ptr, stride_xm, offs_m, m_mask, k_start, k_hi, K, norm_ptr, inv_rms,
                                 x_inv, acc, BLOCK_K, NORM, EVEN_K, IEEE, FP8_MODE)
            k_start += BLOCK_K
        if FP8_MODE == 5:
            if tl.max(fresh.to(tl.int32), axis=0) > 0:  # a row starting its request: its own loop
                acc = _fresh_dots(x_ptr, stride_xm, dv_ptr, stride_vm, dvn_ptr, offs_m, m_mask, fresh,
                                  inverse_scale(fresh_scale), w_ptr, rows, row_mask, offs_k, k_start, k_hi, K, acc,
                                  BLOCK_K, EVEN_K, EVEN_N, IEEE, X_NORM)
            else:
                acc = _k_dots(x_ptr, stride_xm, offs_m, m_mask, offs_k, k_start, k_hi, K, norm_ptr, inv_rms, x_inv,
                              w_ptr, rows, row_mask, acc, BLOCK_K, NORM, EVEN_K, EVEN_N, IEEE, FP8_MODE)
        else:
            acc = _k_dots(x_ptr, stride_xm, offs_m, m_mask, offs_k, k_start, k_hi, K, norm_ptr, inv_rms, x_inv, w_ptr,
                          rows, row_mask, acc, BLOCK_K, NORM, EVEN_K, EVEN_N, IEEE, FP8_MODE)
        if SPLIT_K > 1:
            # partials: (SPLIT_K, tile rows of the grid, 16) float32; this program's tile
            ntile = tl.num_programs(0) * BLOCK_N
            part = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[:, None] * 16 + offs_m[None, :])
            tl.store(ws_ptr + tl.program_id(1) * ntile * 16 + part, acc)
            finish = last_arrival(cnt_ptr + pid_n, SPLIT_K)
            if finish:  # the last split of this block: sum in split order
                acc = tl.load(ws_ptr + part, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):
                    acc += tl.load(ws_ptr + s * ntile * 16 + part, cache_modifier=".cg")
                reset_arrivals(cnt_ptr + pid_n)  # ready for the next launch (and graph replay)
        else:
            finish = True
        if finish:
            _epilogue(acc, offs_n, partner, n_mask, offs_m, m_mask, scale_ptr, bias_ptr, x_scale,
                      res_ptr, cos_ptr, sin_ptr, out_ptr, amax_ptr, stride_rm, stride_cm, stride_om, ROPE_N, FP8,
                      HAS_BIAS, SWIGLU, RESIDUAL, FP8_MODE, ROPE, HEAD_DIM, AMAX_OUT, pid_n, N, dq_ptr, ds_ptr,
                      dnw_ptr, dpo_ptr, stride_qm, min_scale, QUANT_OUT)
        if FP8_MODE == 4:  # every program has read the amax: the last one sets it back to zero
            if last_arrival(amax_cnt_ptr, tl.num_programs(0) * tl.num_programs(1)):
                tl.store(amax_ptr + offs_m, tl.zeros((16,), tl.int32))
                reset_arrivals(amax_cnt_ptr)

    @triton.jit
    def _preloaded_dot(w, x_ptr, stride_xm, offs_m, m_mask, k0, k_hi, K, norm_ptr, inv_rms, x_inv, acc,
                       BLOCK_K: tl.constexpr, NORM: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                       FP8_MODE: tl.constexpr):
        """``acc`` plus the preloaded weight tile ``w`` (columns ``[k0, k0 + BLOCK_K)``) times its activation
        tile where ``k0`` is inside the program's range (``k0 < k_hi``; then, with ``EVEN_K``, every column
        is below K), else ``acc`` unchanged (a tile past the range is no part of this program's sum)."""
        if k0 < k_hi:
            x_t = tl.trans(_x_tile(x_ptr, stride_xm, offs_m, m_mask, k0 + tl.arange(0, BLOCK_K), K, norm_ptr,
                                   inv_rms, NORM, EVEN_K))
            acc = _tile_dot(w, _activation_operand(x_t, x_inv, FP8_MODE), acc, IEEE, FP8_MODE)
        return acc

    @triton.jit
    def _activation_operand(x_t, x_inv, FP8_MODE: tl.constexpr):
        """The ``(BLOCK_K, 16)`` activation tile as the dot's right operand: float16, saturated (``FP8_MODE``
        1 and 2: float16 products); E4M3 codes times each row's inverse scale ``x_inv`` (4: W8A8 quantized here);
        as loaded otherwise (activation-dtype products; 3: E4M3 codes already)."""
        if FP8_MODE == 1 or FP8_MODE == 2:
            x_t = _f16_saturated(x_t)
        if FP8_MODE == 4:
            x_t = quantize_values(x_t.to(tl.float32), x_inv[None, :], E4M3_MAX)
        return x_t

    @triton.jit
    def _pair_rows(pid_n, N, BLOCK_N: tl.constexpr, ROPE: tl.constexpr, HEAD_DIM: tl.constexpr):
        """A paired program's weight rows: tile row ``j < BLOCK_N / 2`` is pair ``p = pid_n * BLOCK_N / 2 +
        j``'s first row, row ``BLOCK_N / 2 + j`` its partner (SWIGLU: gate row ``p``, up row ``N + p``;
        ROPE: the p-th first-half column ``c`` of the heads and ``c + HEAD_DIM / 2``). Returns the
        ``(BLOCK_N,)`` rows and their mask, then the ``(BLOCK_N / 2,)`` output columns of the pairs'
        first and second members and their mask."""
        HALF: tl.constexpr = BLOCK_N // 2
        pairs = N // 2 if ROPE else N
        j = tl.arange(0, BLOCK_N)
        p = pid_n * HALF + j % HALF
        cols = pid_n * HALF + tl.arange(0, HALF)
        if ROPE:
            first = p // (HEAD_DIM // 2) * HEAD_DIM + p % (HEAD_DIM // 2)
            rows = tl.where(j >= HALF, first + HEAD_DIM // 2, first)
            offs_n = cols // (HEAD_DIM // 2) * HEAD_DIM + cols % (HEAD_DIM // 2)
            partner = offs_n + HEAD_DIM // 2
        else:
            rows = tl.where(j >= HALF, p + N, p)
            offs_n = cols
            partner = cols + N
        return rows, p < pairs, offs_n, partner, cols < pairs

    @triton.jit
    def _split_pairs(acc, HALF: tl.constexpr):
        """A paired tile's ``(2 * HALF, 16)`` sums as the first members' ``(HALF, 16)`` and the partners'."""
        return tl.split(tl.permute(tl.reshape(acc, (2, HALF, 16)), (1, 2, 0)))

    def _even_n(a) -> bool:
        """Every program's weight rows in range (a paired program covers BLOCK_N / 2 of the N / 2 RoPE
        pairs or of the N SwiGLU pairs)."""
        if a.get("ROPE") or a.get("SWIGLU"):
            return (a["N"] // 2 if a.get("ROPE") else a["N"]) % (a["BLOCK_N"] // 2) == 0
        return a["N"] % a["BLOCK_N"] == 0

    _kernel = triton.heuristics({"EVEN_N": _even_n})(_gemv_kernel)

    def _allowed(c: GemvConfig, n: int, x_dtype: torch.dtype, w_dtype: torch.dtype, meta: dict) -> bool:
        """Whether candidate ``c`` may launch this variant: it fits shared memory and is no wider than N."""
        return c.block_n <= max(16, triton.next_power_of_2(n)) and fits_shared_memory(
            dataclasses.replace(c, block_k=meta["BLOCK_K"]), x_dtype, w_dtype)

    def _prune(configs, named_args, **meta):
        """Drop candidates `_allowed` refuses."""
        kept = [c for c in configs if _allowed(GemvConfig(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages),
                                               named_args["N"], named_args["x_ptr"].dtype,
                                               named_args["w_ptr"].dtype, meta)]
        return kept or configs[:1]

    def _autotuned(configs):
        return triton.autotune(
            configs=[triton.Config({"BLOCK_N": c.block_n}, num_warps=c.num_warps, num_stages=c.num_stages)
                     for c in configs],
            key=list(TUNING_KEY),
            prune_configs_by={"early_config_prune": _prune},
            # timing runs read (FP8_MODE 4, then zero it) or max into (AMAX_OUT) the amax buffer: each
            # one starts from the caller's amax, and so does the launch that counts
            restore_value=["amax_ptr", "ds_ptr", "roll_ptr"],
            do_bench=lambda fn, quantiles: triton.testing.do_bench(fn, warmup=TUNING_MS[0], rep=TUNING_MS[1],
                                                                   quantiles=quantiles),
        )(_kernel)

    _TUNERS = {configs: _autotuned(configs) for configs in (TUNED_CONFIGS, FP8_TUNED_CONFIGS, W8A8_TUNED_CONFIGS)}


def gemv(
    x: torch.Tensor | QuantizedRows | RowsWithAmax,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    config: GemvConfig | None = None,
    norm_in_prologue: bool = False,
    fp8_compute: str | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rope_columns: int = 0,
    amax_out: torch.Tensor | None = None,
    rows: int | None = None,
    delayed_out: DelayedOut | None = None,
    roll: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, DelayedRows]:
    """``out = epilogue(linear(prologue(x)))`` for decode-sized batches: one launch, two with the norm.

    Steps, each optional: ``h = RMSNorm(x)`` (``norm_weight``), ``y = h @ (weight * weight_scale).T +
    bias`` (float32 accumulation, rounded to ``x.dtype``), ``y = silu(y[:, :N]) * y[:, N:]``
    (``swiglu``), ``y = y + residual``, or RoPE of ``y``'s first ``rope_columns`` columns (``cos``,
    ``sin``). Numerics: `stage_ar.gemv_reference.gemv_reference`.

    Args:
        x: ``(M, K)`` activations, ``1 <= M <= 16``, bfloat16/float16/float32, rows contiguous; or,
            for W8A8 (E4M3 weights, ``fp8_compute`` None or ``"fp8"``, no ``norm_weight``), those rows
            quantized already (`stage_ar.fp8_activations.QuantizedRows`, ``codes`` 2-D: its add, norm
            and quantization were the producer's launch), whose ``dtype`` stands for ``x.dtype`` below;
            or rows with their amax gathered by the launch that wrote them
            (`stage_ar.fp8_activations.RowsWithAmax`, W8A8 likewise), quantized in this launch's
            prologue with `quantize_rows`' codes and scales (one launch less), ``x.values`` below; or
            rows a producer quantized with delayed scales (`stage_ar.fp8_activations.DelayedRows`, W8A8
            likewise: an experiment, see ``delayed_out``).
        weight: ``(R, K)`` contiguous, ``x.dtype`` or ``torch.float8_e4m3fn``; ``R = N``, or ``2 * N``
            (gate rows then up rows) with ``swiglu``.
        weight_scale: ``(R,)`` float32 per-row scales; required with and only with FP8 weights.
        bias: ``(R,)`` in ``x.dtype``.
        norm_weight: ``(K,)`` in ``x.dtype``: apply Qwen2 RMSNorm (``norm_eps``) to ``x`` first.
        residual: ``(M, N)`` in ``x.dtype``, rows contiguous, added last.
        swiglu: the fused gate/up epilogue.
        config: launch parameters; ``None`` autotunes on CUDA (`TUNED_CONFIGS`) and takes
            `INTERPRETER_CONFIG` under the interpreter.
        norm_in_prologue: apply the norm inside the GEMV (every program normalises every tile:
            measured slower on the H200, 2026-12-01: +4 us qkv, +17 us gate_up) instead of
            `rms_norm_rows` first (the default). Same numerics, other summation order.
        fp8_compute: FP8 weights only (`FP8_COMPUTES`): ``"activation"`` widens the codes to
            ``x.dtype`` (exact) and multiplies in it; ``"float16"`` widens codes (the hardware's E4M3 ->
            float16 conversion) and activations to float16 and multiplies there; ``"float16_bits"``
            the same products with the codes widened by integer operations (measured slower).
            Codes and bfloat16 activations are exact in float16, so all three give the same bits
            while every ``|x| <= 65504`` (and ``>= 2^-17``, float16's subnormal resolution); larger
            activations saturate at +-65504 in the float16 modes. ``"fp8"`` (W8A8, opt-in, not yet
            measured): each activation row quantized to E4M3 with its own scale first
            (`stage_ar.fp8_activations.quantize_rows`, a second launch that also applies the norm,
            with `rms_norm_rows`' bits), FP8 x FP8 tensor-core dots in float32, ``acc * scale[n] *
            x_scale[m]``: other numerics (`stage_ar.gemv_reference.gemv_reference`'s ``fp8_compute``).
            ``None`` (the default):
            `default_fp8_compute` (``"float16"`` for 16-bit activations: 1.5 x faster than
            ``"activation"`` per visual token on the H200, 2026-12-01).
        cos, sin: ``(M, head_dim)`` in ``x.dtype``, contiguous, each row's RoPE table (as
            `stage_ar.modeling_mammoth_ar.MammothRotaryEmbedding` makes them): rotate output columns
            ``[0, rope_columns)``, heads of ``head_dim`` columns in the rotate-half layout (column ``c``
            of a head pairs with ``c + head_dim / 2``), rounded as `stage_ar.layers.apply_rope`; the
            other columns (a fused qkv's v heads) pass through. Each program computes both columns of
            its pairs (one tile of both rows, as swiglu). ``head_dim`` must be even and divide N; not with
            ``swiglu`` or ``residual``.
        rope_columns: a multiple of ``head_dim`` in ``[0, N]`` (the q and k columns of a fused qkv).
        amax_out: ``(16,)`` int32 zeros, or the ``amax`` of `stage_ar.fp8_activations.amax_buffers`:
            each output row's largest magnitude is max-ed into it (float32 bits) for the W8A8 launch
            that reads the output as `stage_ar.fp8_activations.RowsWithAmax`; not with RoPE.
        rows: compute only the first ``rows`` rows (``1 <= rows``; None or ``>= M``: all). The output
            keeps its ``M`` rows; rows from ``rows`` on are left unwritten (whatever the allocator
            gave). A computed row's bits are the same as with every row computed, since a row's
            arithmetic never depends on M (the runner's ``trim_gemv_rows``: idle slots' rows of a
            padded step are not loaded).
        delayed_out: (W8A8, opt-in experiment of issue 17) also write the output rows as E4M3 codes
            for the W8A8 GEMV that reads them, quantized with delayed scales
            (`stage_ar.fp8_activations.DelayedOut`; with its ``norm_weight``, of the rows' RMSNorm,
            applied by the consumer); not with RoPE or ``amax_out``.
        roll: a layer's `stage_ar.fp8_activations.delayed_state`: this launch's first program moves the
            amax its points gathered to the half the next step's scales read (once per step, after
            every consumer of the layer's points, before the first producer of the next step).

    Returns:
        ``(M, N)`` in ``x.dtype``, a new tensor; with ``delayed_out``, ``(that, DelayedRows)``.

    Raises:
        ValueError: shapes, strides, devices or flags that do not fit the above.
        TypeError: dtypes that do not fit the above.
        RuntimeError: triton cannot run on ``x``'s device (check `available`).
    """
    x_scales, dtype, amax_in = None, x.dtype if not isinstance(x, RowsWithAmax) else x.values.dtype, None
    delayed_in = x if isinstance(x, DelayedRows) else None
    if delayed_in is not None:
        if (fp8_compute or "fp8") != "fp8" or weight.dtype != FP8_DTYPE or norm_weight is not None:
            raise ValueError(f"DelayedRows take E4M3 weights and fp8_compute='fp8' (W8A8), no norm_weight; got "
                             f"{weight.dtype} weights and fp8_compute={fp8_compute!r}")
        fp8_compute = "fp8"
        x = delayed_in.codes
        x_scales = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)  # shape check only; unread
    if delayed_out is not None and (cos is not None or amax_out is not None):
        raise ValueError("delayed_out does not combine with the RoPE epilogue or amax_out")
    if isinstance(x, (QuantizedRows, RowsWithAmax)):
        if (fp8_compute or "fp8") != "fp8" or weight.dtype != FP8_DTYPE:
            raise ValueError(f"{type(x).__name__} take E4M3 weights and fp8_compute='fp8' (W8A8), got "
                             f"{weight.dtype} weights and fp8_compute={fp8_compute!r}")
        fp8_compute = "fp8"
        if isinstance(x, QuantizedRows):
            x, x_scales = x.codes, x.scales
        else:
            if norm_weight is not None:
                raise ValueError("RowsWithAmax are quantized as they are: no norm_weight")
            expect_tensor("amax", x.amax, (MAX_ROWS,), torch.int32, x.values.device)
            expect_tensor("counter", x.counter, (1,), torch.int32, x.values.device)
            x, amax_in = x.values, x
    if amax_out is not None:
        expect_tensor("amax_out", amax_out, (MAX_ROWS,), torch.int32, x.device)
        if cos is not None:
            raise ValueError("amax_out does not combine with the RoPE epilogue")
    n = check_gemv_args(x, weight, weight_scale, bias, norm_weight, residual, swiglu, cos, sin, rope_columns,
                        x_scales, dtype)
    fp8_compute = fp8_compute or default_fp8_compute(dtype)
    check_fp8_compute(fp8_compute, dtype)
    if not available(x.device):
        raise RuntimeError(f"gemv needs triton and a CUDA device (or TRITON_INTERPRET=1), got {x.device}")
    w8a8 = fp8_compute == "fp8" and weight.dtype == FP8_DTYPE
    if delayed_out is not None and not w8a8:
        raise ValueError("delayed_out needs a W8A8 launch (E4M3 weights, fp8_compute='fp8')")
    full = out = torch.empty((x.shape[0], n), dtype=dtype, device=x.device)
    delayed = None
    if delayed_out is not None:
        parts = -(-n // NORM_GROUP) if delayed_out.norm_weight is not None else 0
        if delayed_out.norm_weight is not None:
            expect_tensor("delayed_out.norm_weight", delayed_out.norm_weight, (n,), dtype, x.device)
        delayed = DelayedRows(torch.empty((x.shape[0], n), dtype=FP8_DTYPE, device=x.device), delayed_out.state,
                              delayed_out.point, torch.empty((MAX_ROWS, parts), dtype=torch.float32, device=x.device)
                              if parts else None, delayed_out.norm_eps, dtype, full, delayed_out.norm_weight)
    if rows is not None and rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    codes_out = delayed.codes if delayed is not None else None
    if rows is not None and rows < x.shape[0]:  # the launch sees M = rows; the rest stays unwritten
        x, out = x[:rows], out[:rows]
        codes_out = codes_out[:rows] if codes_out is not None else None
        x_scales, residual, cos, sin = (t[:rows] if t is not None else None for t in (x_scales, residual, cos, sin))
    if w8a8 and x_scales is None and amax_in is None:  # the norm (if any) and the quantization in one launch
        x, x_scales = quantize_rows(x, norm_weight, norm_eps)
        norm_weight = None
    elif norm_weight is not None and not norm_in_prologue:
        x, norm_weight = rms_norm_rows(x, norm_weight, norm_eps), None
    rope = (cos, sin, rope_columns) if cos is not None else None
    _launch(x, weight, weight_scale, bias, norm_weight, norm_eps, residual, swiglu, config, fp8_compute, out, rope,
            x_scales, amax_in, amax_out, (delayed_in, delayed_out, codes_out, delayed, roll))
    return full if delayed is None else (full, delayed)


def default_fp8_compute(x_dtype: torch.dtype) -> str:
    """How FP8 weights are multiplied with activations of ``x_dtype`` unless a call says otherwise:
    ``"float16"`` for 16-bit activations, ``"activation"`` (exact widening) for float32 ones."""
    return "activation" if x_dtype == torch.float32 else "float16"


def _launch(x, weight, weight_scale, bias, norm_weight, norm_eps, residual, swiglu, config, fp8_compute, out,
            rope=None, x_scales=None, amax_in=None, amax_out=None, delayed=(None,) * 5) -> None:
    """One `_gemv_kernel` launch writing ``out (M, N)`` (arguments checked by `gemv`); ``rope``:
    ``(cos, sin, rope_columns)`` or None; ``x_scales``: ``(M,)`` float32 row scales of E4M3 ``x`` (W8A8);
    ``amax_in``: the `RowsWithAmax` ``x`` came from (W8A8 quantized in the prologue); ``amax_out``:
    the ``(16,)`` int32 buffer the output rows' amax goes into; ``delayed``: ``(DelayedRows read or None,
    DelayedOut or None, its codes' output view, the DelayedRows it fills, the state to roll or None)``."""
    (m, k), n = x.shape, out.shape[1]
    cos, sin, rope_columns = rope or (out, out, 0)  # dummies in the output dtype (under W8A8 x is E4M3)
    block_k = (config.block_k if config is not None else None) or block_k_for(weight.dtype)
    if block_k & (block_k - 1) or block_k < 16:
        raise ValueError(f"block_k {block_k} must be a power of two >= 16")
    paired = bool(swiglu or rope)
    columns = n // 2 if rope else n  # what a program's tile rows cover: columns, or (paired) column pairs
    split = (config.split_k if config is not None else None) or split_k_for(n, k, weight.dtype, fp8_compute)
    if split < 1:
        raise ValueError(f"split_k must be >= 1, got {split}")
    ws, counters = split_workspace(weight, split, columns, paired) if split > 1 else (out, out)
    amax = amax_in.amax if amax_in is not None else amax_out
    delayed_in, delayed_out, codes_out, delayed_rows, roll = delayed
    if delayed_in is not None:  # FP8_MODE 5: the point's state (first 16 entries) where FP8_MODE 4 has its amax
        amax = delayed_in.state[32 * delayed_in.point:]
        x_scales = None
        if delayed_in.values is None or (delayed_in.partials is None) != (delayed_in.norm_weight is None):
            raise ValueError("DelayedRows need their values, and a norm weight exactly where they carry partials")
        if preload_tiles():
            raise ValueError("DelayedRows do not take preloaded weight tiles (launch_overlap.PRELOAD_TILES)")
    partials_in = delayed_in.partials if delayed_in is not None else None
    autotuned = config is None and not INTERPRETED
    c = config or INTERPRETER_CONFIG
    args = (
        x, weight, _or(weight_scale, out), _or(bias, out), _or(norm_weight, out), _or(residual, out), cos, sin,
        out, _or(x_scales, out), ws, counters, _or(amax, counters), amax_in.counter if amax_in is not None else counters,
        m, n, k, x.stride(0), residual.stride(0) if residual is not None else 0, cos.stride(0) if rope else 0,
        out.stride(0), float(norm_eps if partials_in is None else delayed_in.norm_eps), MIN_ROW_SCALE, rope_columns,
        _or(codes_out, out), delayed_out.state[32 * delayed_out.point:] if delayed_out is not None else counters,
        _or(delayed_out.norm_weight if delayed_out is not None else None, out),
        _or(delayed_rows.partials if delayed_rows is not None else None, out), _or(partials_in, out),
        _or(roll, counters), codes_out.stride(0) if codes_out is not None else 0,
        _or(delayed_in.values if delayed_in is not None else None, out),
        _or(delayed_in.norm_weight if delayed_in is not None else None, out),
        delayed_in.values.stride(0) if delayed_in is not None and delayed_in.values is not None else 0,
    )
    meta = dict(
        BLOCK_K=block_k, LOG2_BLOCK_K=block_k.bit_length() - 1, EVEN_K=k % block_k == 0,
        NORM=norm_weight is not None, FP8=weight.dtype == FP8_DTYPE, HAS_BIAS=bias is not None,
        SWIGLU=bool(swiglu), RESIDUAL=residual is not None,
        IEEE=out.dtype == torch.float32 and x_scales is None and delayed_in is None,  # never on E4M3 codes
        FP8_MODE=(4 if amax_in is not None else _FP8_MODES[fp8_compute]) if weight.dtype == FP8_DTYPE else 0,
        ROPE=rope is not None, HEAD_DIM=cos.shape[1] if rope else 0, SPLIT_K=split, AMAX_OUT=amax_out is not None,
        QUANT_OUT=0 if delayed_out is None else 2 if delayed_out.norm_weight is not None else 1,
        X_NORM=partials_in is not None, ROLL=roll is not None,
        LOG2_PARTS=max(0, (-(-k // NORM_GROUP) - 1).bit_length()) if partials_in is not None else 0,
    )
    if delayed_in is not None:
        meta["FP8_MODE"] = 5
    pdl = pdl_flag(weight.device)
    meta.update(PDL=pdl, PRELOAD=preload_tiles(), **launch_options(pdl))
    if autotuned:
        configs = tuned_configs(weight.dtype, fp8_compute)
        key = pick_key({**meta, "N": n, "K": k}, x.dtype, weight.dtype, out.dtype)
        pinned = pinned_picks(weight.device).get(key)
        if pinned is None or pinned not in configs or not _allowed(pinned, n, x.dtype, weight.dtype, meta):
            # time the candidates (once per key and process)
            tuned = _TUNERS[configs]
            tuned[lambda meta_: (triton.cdiv(columns, meta_["BLOCK_N"] // (2 if paired else 1)), split)](*args, **meta)
            best = tuned.best_config
            _LAST_TUNED[:] = [GemvConfig(best.kwargs["BLOCK_N"], best.num_warps, best.num_stages), split]
            _PICKED[key] = _LAST_TUNED[0]
            return
        _LAST_TUNED[:] = [pinned, split]
        c = _PICKED[key] = pinned
    grid = (triton.cdiv(columns, c.block_n // (2 if paired else 1)), split)
    _kernel[grid](*args, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages, **meta)


#: Column padding of a split launch's partials: the widest ``BLOCK_N`` any launch may use.
_MAX_BLOCK_N = 128


def split_workspace(weight: torch.Tensor, split: int, columns: int, paired: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 partials and int32 arrival counters (all zero between launches) of a split-K
    launch over ``weight`` whose programs' tiles cover ``columns`` output columns (``paired``: column
    pairs, ``BLOCK_N / 2`` per program, each pair two tile rows): ``split * rows * 16`` floats for
    ``rows = (2 if paired else 1) * roundup(columns, 128)`` tile rows, and one counter per program of
    the narrowest block (16 rows: ``cdiv(columns, 8 if paired else 16)``)
    (`stage_ar.arrival.persistent_buffers`: one set per weight, kept for the process, so a CUDA graph
    captured around the launch keeps valid addresses).

    Raises:
        RuntimeError: buffers for more weights than `stage_ar.arrival.MAX_BUFFER_SETS`.
    """
    rows = (2 if paired else 1) * -(-columns // _MAX_BLOCK_N) * _MAX_BLOCK_N
    return persistent_buffers(weight, "gemv_split_k", split * rows * 16, -(-columns // (8 if paired else 16)))


_LAST_TUNED: list = [None, 1]  # the config of the latest autotuned launch (timed or pinned) and its split

def compile_ahead(x_dtype: torch.dtype, weight_dtype: torch.dtype, rows: int, k: int, config: GemvConfig, *,
                  bias: bool = False, norm: bool = False, residual: bool = False, swiglu: bool = False,
                  norm_in_prologue: bool = False, fp8_compute: str | None = None, rope_head_dim: int = 0):
    """Compile the kernel `gemv` launches for this variant and ``config`` without launching it, and
    return Triton's compiled kernel (its ``asm`` dict holds the PTX).

    Fills Triton's on-disk cache, so a pool of processes can compile what autotuning will time
    (compilation is serial inside one process); the process that then calls `gemv` loads the
    binaries. Matches calls whose activations, residual and output rows are contiguous (strides
    ``K`` and ``N``) and whose pointers are 16-byte aligned, as `gemv`'s outputs and row slices of
    such tensors are. Arguments as `gemv`'s (``rows`` =
    weight rows; ``rope_head_dim`` > 0: the RoPE epilogue with ``cos``/``sin`` of that width).

    Raises:
        RuntimeError: triton cannot compile for a CUDA device here.
    """
    if triton is None or INTERPRETED or not torch.cuda.is_available():
        raise RuntimeError("compile_ahead needs triton and a CUDA device")
    n = rows // 2 if swiglu else rows
    block_k = config.block_k or block_k_for(weight_dtype)
    fp8 = weight_dtype == FP8_DTYPE
    norm = norm and norm_in_prologue  # else `rms_norm_rows` runs first and the GEMV has no norm
    fp8_compute = fp8_compute or default_fp8_compute(x_dtype)
    w8a8 = fp8 and fp8_compute == "fp8"
    norm = norm and not w8a8  # W8A8 quantizes the normalised rows first
    split = config.split_k or split_k_for(n, k, weight_dtype, fp8_compute)
    pdl = pdl_flag(torch.device("cuda", torch.cuda.current_device()))
    return _kernel.warmup(
        FP8_DTYPE if w8a8 else x_dtype, weight_dtype, torch.float32 if fp8 else x_dtype, x_dtype,
        x_dtype, x_dtype, x_dtype, x_dtype, x_dtype, torch.float32 if w8a8 else x_dtype, torch.float32 if split > 1 else x_dtype,
        torch.int32 if split > 1 else x_dtype, torch.int32 if split > 1 else x_dtype,
        torch.int32 if split > 1 else x_dtype, MAX_ROWS, n, k, k,
        n if residual else 0, rope_head_dim, n, 1e-6, MIN_ROW_SCALE,
        rope_head_dim and n // 2, x_dtype, torch.int32 if split > 1 else x_dtype, x_dtype, x_dtype, x_dtype,
        torch.int32 if split > 1 else x_dtype, 0, x_dtype, x_dtype, 0,
        grid=(1,), BLOCK_N=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages,
        BLOCK_K=block_k, LOG2_BLOCK_K=block_k.bit_length() - 1, EVEN_K=k % block_k == 0, NORM=norm, FP8=fp8,
        HAS_BIAS=bias, SWIGLU=swiglu, RESIDUAL=residual, IEEE=x_dtype == torch.float32 and not w8a8,
        FP8_MODE=_FP8_MODES[fp8_compute] if fp8 else 0, ROPE=rope_head_dim > 0, HEAD_DIM=rope_head_dim,
        SPLIT_K=split, PDL=pdl, PRELOAD=preload_tiles(), **launch_options(pdl),
    )


def last_tuned_config() -> GemvConfig | None:
    """The config autotuning used for the latest autotuned `gemv` call, with the split count the
    shape's rule gave it (``None`` before any, or under the interpreter)."""
    if triton is None or INTERPRETED or _LAST_TUNED[0] is None:
        return None
    return dataclasses.replace(_LAST_TUNED[0], split_k=_LAST_TUNED[1])


def forget_tuning() -> int:
    """Drop every autotuned pick of this process, so that the next launch of each shape tunes again,
    at the row count it then has. The autotuning key leaves the row count M out (every candidate
    gives the same bits at every M), so a process tunes each shape once, at its first M: a served
    process at its padded M = 16 (`stage_ar.runner.ARModelRunner.capture`'s warm-up steps), a
    batch-1 benchmark at M = 1. A benchmark that times both shapes in one process calls this between
    them, so each runs with the picks its own process would have made. Returns the picks dropped."""
    dropped = 0
    if triton is not None and not INTERPRETED:
        for tuner in _TUNERS.values():
            dropped += len(tuner.cache)
            tuner.cache.clear()
    _PICKED.clear()
    return dropped


#: The config each autotuned launch key ran with in this process (timed or pinned), by `pick_key`.
_PICKED: dict[str, GemvConfig] = {}
#: Pinned picks per CUDA device index (`pinned_picks`), read once.
_PINNED: dict[int, dict[str, GemvConfig]] = {}


def _load_named_picks(path: str) -> dict[str, GemvConfig]:
    """`load_picks` of the file `PICKS_ENV` names; its errors (same types) name the variable too, so
    the AR's one start-up line says where the path came from."""
    try:
        return load_picks(path)
    except ValueError as exc:
        raise ValueError(f"{PICKS_ENV}: {exc}") from None
    except OSError as exc:
        raise OSError(exc.errno, f"{PICKS_ENV}: {exc.strerror or exc}", path) from None


def pinned_picks(device: torch.device) -> dict[str, GemvConfig]:
    """The picks pinned for ``device``, by `pick_key`: the file `PICKS_ENV` names (on any device, so a
    bad path fails the start even on a CPU), else on CUDA the one shipped for this GPU's name
    (`shipped_picks_path`), else none (every variant is timed at its first launch). A key missing from
    the file, or whose pick is not among the launch's candidates, is timed as without a file. Read once
    per device and process.

    Raises:
        ValueError, OSError: the file `PICKS_ENV` names cannot be read as picks (`load_picks`); a
            shipped file that does not parse is logged and ignored.
    """
    path = os.environ.get(PICKS_ENV)
    if device.type != "cuda":
        return _load_named_picks(path) if path else {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PINNED:
        if path:
            _PINNED[index] = _load_named_picks(path)
            logger.info("GEMV picks: %d pinned from %s (%s)", len(_PINNED[index]), path, PICKS_ENV)
        else:
            path = shipped_picks_path(torch.cuda.get_device_name(index))
            try:
                _PINNED[index] = load_picks(path) if os.path.exists(path) else {}
            except (OSError, ValueError) as exc:
                logger.warning("GEMV picks shipped for this GPU are unreadable, timing every shape: %s", exc)
                _PINNED[index] = {}
    return _PINNED[index]


def tuned_picks() -> dict[str, list[int]]:
    """What each autotuned GEMV variant of this process launched with, by `pick_key`:
    ``[block_n, num_warps, num_stages]`` (the format of a picks file's ``picks``)."""
    return {key: [c.block_n, c.num_warps, c.num_stages] for key, c in sorted(_PICKED.items())}


def _or(tensor: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """A pointer argument the kernel will not read when its flag is off."""
    return dummy if tensor is None else tensor
