"""FP8 (E4M3) weights with one float32 scale per output channel, converted at load time.

Layout: a linear layer's ``weight (N, K)`` becomes ``w_fp8 (N, K)`` in ``torch.float8_e4m3fn`` and
``scale (N,)`` in float32 with ``weight[n, k] ≈ w_fp8[n, k] * scale[n]``. ``scale[n]`` maps row ``n``'s
largest magnitude onto E4M3's largest finite value, 448, so each row uses the whole range.
`stage_ar.gemv` consumes this layout (W8A16: weights widened in registers, the scale applied once
per output in the epilogue).

Error of one weight (round to nearest even in E4M3's 3 mantissa bits): at most 2^-4 of its
magnitude in the normal range, at most ``2^-10 * scale[n]`` below it (subnormals, values under
``2^-6 * scale[n]``); zero rows get scale 1 and stay exactly zero. A scale is never below `MIN_SCALE`
(float32's smallest normal number): a row whose largest magnitude is under ``448 * MIN_SCALE``
(about 5.3e-36) keeps the floor and uses fewer codes, its error still at most ``2^-10 * MIN_SCALE``.

A checkpoint may hold the visual-token projections in this layout already (`stage_ar.fp8_checkpoint`
writes one): each such weight under its checkpoint name (``...q_proj.weight``) as ``F8_E4M3`` codes,
``...q_proj.weight_scale`` ``(N,)`` float32 beside it, and `QUANTIZATION_CONFIG` as ``llm_config``'s
``quantization_config`` (`stores_fp8`). The AR then loads the codes as they are.
"""

from __future__ import annotations

from typing import Any

import torch

#: E4M3 ("fn": finite, no infinities) largest finite magnitude.
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
FP8_DTYPE = torch.float8_e4m3fn
#: The smallest row scale (float32's smallest normal number, 2^-126): ``amax / 448`` of a row of tiny
#: float32 weights (largest magnitude 1e-44, say) underflows to 0, which would make its codes NaN, and a
#: subnormal scale would lose bits (and be flushed to zero by GPU kernels).
MIN_SCALE = float(torch.finfo(torch.float32).tiny)
#: ``llm_config["quantization_config"]`` of a checkpoint storing the visual-token projections as E4M3
#: codes with per-output-channel scales (the layout above; activations are not stored quantized: W8A16
#: or, with ``weights_dtype: fp8-w8a8``, quantized per row at run time).
QUANTIZATION_CONFIG = {"quant_method": "fp8", "weights": "float8_e4m3fn, one float32 scale per output channel",
                       "modules": "visual_token_linears", "activation_scheme": "dynamic"}


def stores_fp8(llm_config: dict[str, Any]) -> bool:
    """Whether a checkpoint's ``llm_config`` says its visual-token projections are stored in FP8
    (`QUANTIZATION_CONFIG`); False without a ``quantization_config``.

    Raises:
        ValueError: a ``quantization_config`` this code cannot load (another method or layout).
    """
    config = llm_config.get("quantization_config")
    if config is None:
        return False
    if config != QUANTIZATION_CONFIG:
        raise ValueError(f"llm_config.quantization_config {config!r} is not one this AR loads; it loads "
                         f"{QUANTIZATION_CONFIG!r} (written by `mammoth quantize-checkpoint`) or none")
    return True


#: Rows converted per step: bounds the float32 temporary at load time (a 37888 x 3584 weight
#: would need 543 MB at once).
_CHUNK_ROWS = 4096


def quantize_fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert a ``(N, K)`` weight to E4M3 codes with one float32 scale per output row.

    Args:
        weight: ``(N, K)`` floating-point weight (bfloat16, float16 or float32), any device.

    Returns:
        ``(w_fp8, scale)``: ``w_fp8 (N, K)`` ``torch.float8_e4m3fn`` (contiguous, finite), ``scale (N,)``
        float32, each at least `MIN_SCALE` (1 for an all-zero row), both on ``weight``'s device.

    Raises:
        ValueError: ``weight`` is not 2-D or holds a non-finite value.
        TypeError: ``weight`` is not floating point, or is already FP8.
    """
    if weight.ndim != 2:
        raise ValueError(f"quantize_fp8_per_channel takes a 2-D (N, K) weight, got shape {tuple(weight.shape)}")
    if weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"weight is already {weight.dtype}")
    if not weight.is_floating_point():
        raise TypeError(f"quantize_fp8_per_channel takes a floating-point weight, got {weight.dtype}")
    w_fp8 = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for lo in range(0, weight.shape[0], _CHUNK_ROWS):
        rows = weight[lo : lo + _CHUNK_ROWS].float()
        if not torch.isfinite(rows).all():
            raise ValueError(f"weight rows {lo}..{lo + rows.shape[0] - 1} hold a non-finite value")
        amax = rows.abs().amax(dim=1)
        row_scale = torch.where(amax > 0, (amax / FP8_MAX).clamp_(min=MIN_SCALE), torch.ones_like(amax))
        w_fp8[lo : lo + rows.shape[0]] = (rows / row_scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        scale[lo : lo + rows.shape[0]] = row_scale
    return w_fp8, scale


def dequantize_fp8_per_channel(w_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_fp8_per_channel`: ``(w_fp8.float() * scale[:, None]).to(dtype)``.

    Args:
        w_fp8: ``(N, K)`` ``torch.float8_e4m3fn`` codes.
        scale: ``(N,)`` float32 per-row scales.
        dtype: dtype of the result.

    Returns:
        ``(N, K)`` weight in ``dtype`` (the product is formed in float32, then rounded once).

    Raises:
        ValueError: ``scale`` does not have one entry per row of ``w_fp8``.
        TypeError: ``w_fp8`` is not E4M3.
    """
    if w_fp8.dtype != FP8_DTYPE:
        raise TypeError(f"w_fp8 must be {FP8_DTYPE}, got {w_fp8.dtype}")
    if w_fp8.ndim != 2 or scale.shape != (w_fp8.shape[0],):
        raise ValueError(f"scale {tuple(scale.shape)} must be (N,) for w_fp8 {tuple(w_fp8.shape)}")
    return (w_fp8.float() * scale.float()[:, None]).to(dtype)
