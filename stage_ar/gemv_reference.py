"""Pure-torch reference of `stage_ar.gemv`: the eager module chain whose numerics the kernels match.

``RMSNorm`` (the model's own Qwen2 numerics, not a copy of them) → linear in float32
(``x.float() @ w.float().T``; FP8 codes times their row scale, then the bias) rounded to the
activation dtype → ``silu(gate) * up`` (`stage_ar.layers.silu_and_mul`) in that dtype →
``+ residual`` in that dtype, or RoPE of the first ``rope_columns`` (`stage_ar.layers.apply_rope`
per head, in that dtype). The kernels compute the same steps with the same roundings; they differ
only in the order of the dot's float32 sums (and, with the norm, in the order of the sum of
squares), i.e. by float32 rounding before the final cast. Runs on any device; used by the tests and
by `benchmarks/gemv.py` as ground truth.
"""

from __future__ import annotations

import torch

from stage_ar.gemv_checks import check_fp8_compute, check_gemv_args
from stage_ar.fp8 import FP8_MAX
from stage_ar.fp8_activations import MIN_ROW_SCALE
from stage_ar.gemv_configs import FP8_DTYPE
from stage_ar.layers import apply_rope, silu_and_mul

try:  # the repository's one Qwen2 RMSNorm once the AR engine rebuild (issue 16) has landed
    from mammoth_core.norms import rms_norm as _rms_norm
except ImportError:  # until then: the model's own module
    from stage_ar.modeling_mammoth_ar import MammothRMSNorm

    def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        norm = MammothRMSNorm(weight.shape[0], eps).to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
            return norm(x)


def rms_norm_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's Qwen2 RMSNorm of ``x (M, K)`` with ``norm_weight (K,)``, in ``x.dtype``."""
    return _rms_norm(x, norm_weight, eps)


@torch.no_grad()
def gemv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    weight_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    rope_columns: int = 0,
    fp8_compute: str | None = None,
) -> torch.Tensor:
    """What `stage_ar.gemv.gemv` computes, step by step in torch (same arguments, same checks).

    ``fp8_compute="fp8"`` with FP8 weights (W8A8): the (normalised) rows are quantized by
    `quantize_rows_reference` and the linear is ``((codes.float() @ w_codes.float().T) * weight_scale)
    * x_scale[:, None]``; every other ``fp8_compute`` gives the W8A16 numerics computed here
    regardless (the kernels' modes agree bit for bit within float16's range)."""
    check_gemv_args(x, weight, weight_scale, bias, norm_weight, residual, swiglu, cos, sin, rope_columns)
    if fp8_compute is not None:
        check_fp8_compute(fp8_compute, x.dtype)
    h = x if norm_weight is None else rms_norm_reference(x, norm_weight, norm_eps)
    w8a8 = fp8_compute == "fp8" and weight.dtype == FP8_DTYPE
    x_scale = None
    if w8a8:
        h, x_scale = quantize_rows_reference(h)
    acc = h.float() @ weight.float().T
    if weight.dtype == FP8_DTYPE:
        acc = acc * weight_scale
    if x_scale is not None:
        acc = acc * x_scale[:, None]
    if bias is not None:
        acc = acc + bias.float()
    y = acc.to(x.dtype)
    if swiglu:
        y = silu_and_mul(y)
    if residual is not None:
        y = y + residual
    if cos is not None and rope_columns:
        m, d = cos.shape
        heads = y[:, :rope_columns].reshape(m, rope_columns // d, d)
        rotated = apply_rope(heads, cos[:, None], sin[:, None]).reshape(m, rope_columns)
        y = torch.cat([rotated, y[:, rope_columns:]], dim=1)
    return y


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`stage_ar.fp8_activations.quantize_rows` in torch: ``x (M, K)`` (any float dtype) ->
    ``codes (M, K)`` ``float8_e4m3fn`` and ``scales (M,)`` float32, ``scale = max(amax(|row|) / 448,
    MIN_ROW_SCALE)``, ``codes = e4m3(clamp(row * (1 / scale), -448, 448))`` (the product float32)."""
    xf = x.float()
    # Both divisions correctly rounded float32 on every device: torch on CUDA divides by a Python
    # scalar as a multiplication by its reciprocal (not IEEE), so each quotient is taken in float64
    # and rounded once to float32 (exact: float64 holds more than twice float32's precision).
    scales = (xf.abs().amax(dim=1).double() / FP8_MAX).float().clamp_min(MIN_ROW_SCALE)
    inverses = (1.0 / scales.double()).float()
    codes = (xf * inverses[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scales


def dequantize_rows_reference(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes (M, K)`` E4M3 times ``scales (M,)``, float32: the activations W8A8 actually multiplies."""
    return codes.float() * scales[:, None]
