"""Qwen2 RMSNorm of activation rows for the decode kernels (CUDA, Triton; Triton's interpreter on
CPU tensors): `rms_norm_rows` (one program per row, its own launch before a GEMV) and the
pieces the W8A8 quantizer (`stage_ar.fp8_activations.quantize_rows`) inlines so that the residual
add, the norm and the quantization are one launch with the same bits as separate launches.

Numerics: ``round(norm_weight * round(x * rsqrt(mean(x²) + eps)))``, statistics in float32, ``round``
the cast to the activation dtype (the model's `Qwen2RMSNorm` chain). A row's inverse RMS is summed
column-wise over `NORM_BLOCK`-column chunks in order, then by a fixed pairwise tree (never a
layout-dependent ``tl.sum``), so its bits depend on the row alone, never on M.
"""

from __future__ import annotations

import torch

from stage_ar.gemv_checks import expect_tensor

try:  # triton ships with CUDA builds of torch; CPU-only installs do not have it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

#: Columns per chunk of the inverse RMS's sum (fixed: it sets the sum-of-squares order).
NORM_BLOCK = 1024

if triton is not None:

    @triton.jit
    def row_values(x_ptr, r_ptr, k, K, RESIDUAL: tl.constexpr):
        """The row's values at columns ``k`` (0 past K) in its dtype: ``x[k]``, or with ``RESIDUAL``
        ``round(x[k] + r[k])`` (the sum in float32, rounded once to the dtype, as torch adds two
        bfloat16 tensors and as `mammoth_core.norms.add_rms_norm` forms the residual stream)."""
        x = tl.load(x_ptr + k, mask=k < K, other=0.0)
        if RESIDUAL:
            r = tl.load(r_ptr + k, mask=k < K, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        return x

    @triton.jit
    def add_squares(sq, x0, x1, x2, x3):
        """``sq`` plus the squares of four consecutive ``BLOCK``-column chunks of a row (float32), added
        lane by lane in chunk order, each step one fused multiply-add (``sq = fma(x, x, sq)``, one
        rounding): the one expression of the inverse RMS's sum (`row_inv_rms`, and the W8A8
        quantizer's one-pass norm). Written as explicit FMAs so the compiler's contraction cannot
        differ between callers (with ``sq`` a known zero it could fuse another pair)."""
        return tl.fma(x3, x3, tl.fma(x2, x2, tl.fma(x1, x1, tl.fma(x0, x0, sq))))

    @triton.jit
    def inv_rms_of(sq, K, eps, LOG2_BLOCK: tl.constexpr):
        """``rsqrt(sum(sq) / K + eps)`` (float32) of the ``(2^LOG2_BLOCK,)`` lane sums ``sq`` of a row of
        ``K`` columns, the lanes added by a fixed pairwise tree."""
        for _ in tl.static_range(LOG2_BLOCK):
            sq = tl.sum(tl.reshape(sq, (2, sq.shape[0] // 2)), axis=0)
        return tl.rsqrt(tl.sum(sq, axis=0) / K + eps)

    @triton.jit
    def row_inv_rms(x_ptr, r_ptr, K, eps, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, RESIDUAL: tl.constexpr):
        """``rsqrt(mean(v²) + eps)`` (float32) of the row ``v`` at ``x_ptr`` (`row_values`: plus the one at
        ``r_ptr`` with ``RESIDUAL``): column ``j`` of the ``BLOCK`` lanes sums chunks 0, 1, ... in turn
        (four loads in flight, `add_squares`), then a fixed pairwise tree (`inv_rms_of`)."""
        offs = tl.arange(0, BLOCK)
        sq = tl.zeros((BLOCK,), tl.float32)
        for k0 in range(0, K, 4 * BLOCK):
            x0 = row_values(x_ptr, r_ptr, k0 + offs, K, RESIDUAL).to(tl.float32)
            x1 = row_values(x_ptr, r_ptr, k0 + BLOCK + offs, K, RESIDUAL).to(tl.float32)
            x2 = row_values(x_ptr, r_ptr, k0 + 2 * BLOCK + offs, K, RESIDUAL).to(tl.float32)
            x3 = row_values(x_ptr, r_ptr, k0 + 3 * BLOCK + offs, K, RESIDUAL).to(tl.float32)
            sq = add_squares(sq, x0, x1, x2, x3)
        return inv_rms_of(sq, K, eps, LOG2_BLOCK)

    @triton.jit
    def normalized(x, nw, inv):
        """``round(nw * round(x * inv))`` in ``x``'s dtype: values ``x`` of a row with inverse RMS ``inv``
        (float32) and the norm weight ``nw`` at their columns (the Qwen2 RMSNorm chain's two roundings)."""
        xn = (x.to(tl.float32) * inv).to(x.dtype)
        return (xn.to(tl.float32) * nw.to(tl.float32)).to(x.dtype)

    @triton.jit
    def norm_values(x_ptr, r_ptr, w_ptr, k, K, inv, RESIDUAL: tl.constexpr):
        """`normalized` row values at columns ``k`` (0 past K), ``v`` the row's `row_values`."""
        return normalized(row_values(x_ptr, r_ptr, k, K, RESIDUAL), tl.load(w_ptr + k, mask=k < K, other=0.0), inv)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, K, stride_xm, stride_om, eps,
                         BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
        """One row per program: `row_inv_rms`, then `norm_values` chunk by chunk (four per iteration)."""
        x_ptr += tl.program_id(0) * stride_xm
        out_ptr += tl.program_id(0) * stride_om
        offs = tl.arange(0, BLOCK)
        inv = row_inv_rms(x_ptr, x_ptr, K, eps, BLOCK, LOG2_BLOCK, False)
        for k0 in range(0, K, 4 * BLOCK):
            for c in tl.static_range(4):
                k = k0 + c * BLOCK + offs
                tl.store(out_ptr + k, norm_values(x_ptr, x_ptr, w_ptr, k, K, inv, False), mask=k < K)


def rms_norm_rows(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2 RMSNorm of each row, one Triton program per row (so a row's bits never depend on M).

    Args:
        x: ``(M, K)`` activations (bfloat16/float16/float32), rows contiguous.
        norm_weight: ``(K,)`` in ``x.dtype``.
        eps: added to the mean square.

    Returns:
        ``(M, K)`` ``round(norm_weight * round(x * rsqrt(mean(x²) + eps)))`` in ``x.dtype``, contiguous.

    Raises:
        ValueError / TypeError: shapes or dtypes that do not fit; RuntimeError: triton cannot run here.
    """
    from stage_ar.gemv import available  # the one availability rule (CUDA, or the interpreter)

    if x.ndim != 2 or x.stride(1) != 1:
        raise ValueError(f"rms_norm_rows takes a 2-D x with contiguous rows, got {tuple(x.shape)}")
    expect_tensor("norm_weight", norm_weight, (x.shape[1],), x.dtype, x.device)
    if not available(x.device):
        raise RuntimeError(f"rms_norm_rows needs triton and a CUDA device (or TRITON_INTERPRET=1), got {x.device}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(x.shape[0],)](x, norm_weight, out, x.shape[1], x.stride(0), out.stride(0), float(eps),
                                    BLOCK=NORM_BLOCK, LOG2_BLOCK=NORM_BLOCK.bit_length() - 1, num_warps=4)
    return out
