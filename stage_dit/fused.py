"""Fused elementwise kernels of the DiT block on the GPU (Triton): norm + modulation, gate + residual,
QK-norm + RoPE, SiLU·mul.

Eager, a modulated block runs ≈ 40 kernels between its six GEMMs and its attention, each a full pass
over a `(rows, 2304)` bf16 activation: RMSNorm, ``1 + scale`` broadcast and multiply, ``tanh``,
gate multiply, residual add, float32 round trips of RoPE, SiLU then multiply. At 1024² those passes
took ≈ 27 ms of a 102 ms CFG step (docs/PERFORMANCE.md, "DiT (H200)"). Here each chain is one
kernel that reads its inputs once and writes its output once:

- `rms_norm_modulate`: ``rms_norm(x) * weight * (1 + scale[b])`` (scale optional);
- `gated_residual`: ``h + tanh(gate[b]) * rms_norm(y) * weight`` (gate optional);
- `qk_norm_rope`: per head ``rms_norm`` over head_dim, then the interleaved pair rotation of
  `stage_dit.modules.apply_rotary_emb_complex`;
- `silu_mul`: ``silu(a) * b`` (the SwiGLU inner product).

Numerics: everything in float32 from the 16-bit inputs, rounded once to the output dtype (eager
rounds after every op), so the fused block is at least as close to a float32 forward as eager bf16.
Batch invariance by construction: one program handles whole rows (the RMS statistic is one
in-register sum over the row), so a row's bits depend neither on the row count nor on its batch mates.

When it runs: `enabled(x)` — CUDA tensors in bf16/fp16, ``triton`` importable and `ENABLED` true.
CPU runs (and float32 CUDA runs, the fidelity reference) keep the eager modules unchanged, bit for
bit. ``TRITON_INTERPRET=1`` runs the kernels themselves on CPU tensors (the CPU test session turns
it on, `tests/conftest.py`; `tests/unit/test_dit_fused.py`).
"""

from __future__ import annotations

import os

import torch

try:  # triton ships with CUDA builds of torch; CPU-only installs may not have it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

#: Process-wide switch of the fused path (benchmarks turn it off to measure the eager block).
ENABLED = True
#: Triton's interpreter was on when triton was imported (``TRITON_INTERPRET=1``; CPU tests).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_HALF = (torch.bfloat16, torch.float16)


def enabled(x: torch.Tensor) -> bool:
    """Whether the DiT block runs its fused kernels for activations ``x``: a CUDA tensor in
    bf16/fp16 with triton importable and `ENABLED` set (never on the CPU: that path is the
    reference, unchanged)."""
    return ENABLED and triton is not None and x.is_cuda and x.dtype in _HALF


if triton is not None:

    @triton.jit
    def _rms_norm_row(x_ptr, w_ptr, row, cols, mask, n_cols, eps):
        """Row ``row`` of ``x`` RMS-normalised and times ``w`` (statistics in float32); float32
        ``(BLOCK,)``. The one norm of the two row kernels below."""
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        return x * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _rms_modulate_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, n_cols, rows_per_batch, stride_scale, eps,
                             HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _rms_norm_row(x_ptr, w_ptr, row, cols, mask, n_cols, eps)
        if HAS_SCALE:
            b = row // rows_per_batch
            y = y * (1.0 + tl.load(scale_ptr + b * stride_scale + cols, mask=mask, other=0.0).to(tl.float32))
        tl.store(out_ptr + row * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gated_residual_kernel(h_ptr, y_ptr, w_ptr, gate_ptr, out_ptr, n_cols, rows_per_batch, stride_gate, eps,
                               HAS_GATE: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _rms_norm_row(y_ptr, w_ptr, row, cols, mask, n_cols, eps)
        if HAS_GATE:
            b = row // rows_per_batch
            g = tl.load(gate_ptr + b * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
            e = tl.exp(-2.0 * tl.abs(g))  # tanh(g) = sign(g) (1 - e) / (1 + e), no overflow
            t = (1.0 - e) / (1.0 + e)
            y = y * tl.where(g < 0, -t, t)
        h = tl.load(h_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (h + y).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(x_ptr, w_ptr, rope_ptr, out_ptr, n_rows, heads, eps,
                             HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        # one row = one (token, head) of HEAD_DIM values, loaded contiguously; element j rotates with
        # its pair partner j ^ 1 (a second load of the same cache lines)
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
        j = tl.arange(0, BLOCK_D)[None, :]
        mask = (r < n_rows) & (j < HEAD_DIM)
        jmask = j < HEAD_DIM
        x = tl.load(x_ptr + r * HEAD_DIM + j, mask=mask, other=0.0).to(tl.float32)
        xp = tl.load(x_ptr + r * HEAD_DIM + (j ^ 1), mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
        n = x * rstd * tl.load(w_ptr + j, mask=jmask, other=0.0).to(tl.float32)
        npair = xp * rstd * tl.load(w_ptr + (j ^ 1), mask=jmask, other=0.0).to(tl.float32)
        rope = (r // heads) * HEAD_DIM + (j - (j % 2))  # the token's (cos, sin) of pair j // 2
        c = tl.load(rope_ptr + rope, mask=mask, other=0.0)
        s = tl.load(rope_ptr + rope + 1, mask=mask, other=0.0)
        # even j: x_j c - x_{j+1} s; odd j: x_j c + x_{j-1} s
        out = n * c + tl.where(j % 2 == 0, -npair, npair) * s
        tl.store(out_ptr + r * HEAD_DIM + j, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, (a / (1.0 + tl.exp(-a)) * b).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.ndim != 3 or not x.is_contiguous():
        raise ValueError(f"{name} must be a contiguous (batch, seq, dim) tensor, got {tuple(x.shape)}")
    return x


def _per_batch(v: torch.Tensor | None, batch: int, dim: int, name: str) -> tuple[torch.Tensor | None, int]:
    """A `(>= batch, dim)` per-element vector (rows may be strided, columns contiguous) and its row stride."""
    if v is None:
        return None, 0
    if v.ndim != 2 or v.shape[0] < batch or v.shape[1] != dim or v.stride(1) != 1:
        raise ValueError(f"{name} must be (batch, {dim}) with contiguous columns, got {tuple(v.shape)}")
    return v, v.stride(0)


def _block(n_cols: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n_cols)
    return block, 8 if block >= 2048 else 4


def rms_norm_modulate(x: torch.Tensor, weight: torch.Tensor, eps: float,
                      scale: torch.Tensor | None = None) -> torch.Tensor:
    """``rms_norm(x) * weight * (1 + scale[b])`` in one kernel.

    Args:
        x: contiguous `(batch, seq, dim)`.
        weight: `(dim,)`.
        eps: RMSNorm epsilon.
        scale: `(>= batch, dim)` per-element modulation (columns contiguous), or None (plain RMSNorm).

    Returns:
        `(batch, seq, dim)` in ``x.dtype``.

    Raises:
        ValueError: on other shapes or layouts.
    """
    b, s, d = _rows(x, "x").shape
    scale, stride = _per_batch(scale, b, d, "scale")
    out = torch.empty_like(x)
    if out.numel():
        block, warps = _block(d)
        _rms_modulate_kernel[(b * s,)](x, weight, scale if scale is not None else x, out, d, s, stride, eps,
                                       HAS_SCALE=scale is not None, BLOCK=block, num_warps=warps)
    return out


def gated_residual(h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float,
                   gate: torch.Tensor | None = None) -> torch.Tensor:
    """``h + tanh(gate[b]) * rms_norm(y) * weight`` in one kernel (the block's sandwich-norm residual).

    Args:
        h: the residual stream, contiguous `(batch, seq, dim)`.
        y: the branch output, same shape.
        weight: `(dim,)` of the post-norm.
        eps: RMSNorm epsilon.
        gate: `(>= batch, dim)` pre-tanh gate (columns contiguous), or None (ungated).

    Returns:
        the new residual stream `(batch, seq, dim)` in ``h.dtype``.

    Raises:
        ValueError: on other shapes or layouts.
    """
    b, s, d = _rows(h, "h").shape
    if _rows(y, "y").shape != h.shape:
        raise ValueError(f"y {tuple(y.shape)} must match h {tuple(h.shape)}")
    gate, stride = _per_batch(gate, b, d, "gate")
    out = torch.empty_like(h)
    if out.numel():
        block, warps = _block(d)
        _gated_residual_kernel[(b * s,)](h, y, weight, gate if gate is not None else h, out, d, s, stride, eps,
                                         HAS_GATE=gate is not None, BLOCK=block, num_warps=warps)
    return out


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, rope: torch.Tensor) -> torch.Tensor:
    """Per-head RMSNorm over head_dim, then `stage_dit.modules.apply_rotary_emb_complex`, in one kernel.

    Args:
        x: `(batch, seq, heads, head_dim)`, contiguous (a q or k projection viewed per head).
        weight: `(head_dim,)` of the QK norm.
        eps: its epsilon.
        rope: complex64 `(batch, seq, head_dim / 2)` rotations (`modules.rotary_complex`).

    Returns:
        `(batch, seq, heads, head_dim)` in ``x.dtype``.

    Raises:
        ValueError: on other shapes or an odd head_dim.
    """
    b, s, heads, d = x.shape
    if not x.is_contiguous() or d % 2 or rope.shape != (b, s, d // 2):
        raise ValueError(f"x {tuple(x.shape)} (contiguous, even head_dim) and rope {tuple(rope.shape)} do not fit")
    table = torch.view_as_real(rope.contiguous())  # (b, s, d/2, 2) float32: cos, sin
    out = torch.empty_like(x)
    rows = b * s * heads
    if rows:
        block_r = 16
        _qk_norm_rope_kernel[(triton.cdiv(rows, block_r),)](
            x, weight, table, out, rows, heads, eps, HEAD_DIM=d, BLOCK_R=block_r,
            BLOCK_D=triton.next_power_of_2(d), num_warps=4)
    return out


def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` in one kernel; ``a`` and ``b`` contiguous of one shape; returns ``a``'s dtype.

    Raises:
        ValueError: on mismatched or non-contiguous inputs.
    """
    if a.shape != b.shape or not (a.is_contiguous() and b.is_contiguous()):
        raise ValueError(f"silu_mul needs two contiguous tensors of one shape, got {tuple(a.shape)}, {tuple(b.shape)}")
    out = torch.empty_like(a)
    n = a.numel()
    if n:
        block = 2048
        _silu_mul_kernel[(triton.cdiv(n, block),)](a, b, out, n, BLOCK=block, num_warps=8)
    return out
