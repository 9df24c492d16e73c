"""Argument checks of `stage_ar.gemv.gemv` (and of its torch reference, `stage_ar.gemv_reference`):
one place, so the kernel and the reference refuse the same inputs with the same messages."""

from __future__ import annotations

import torch

from stage_ar.gemv_configs import FP8_DTYPE

#: Largest M (activation rows) one launch takes: the kernels pad to one 16-row tile.
MAX_ROWS = 16
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: How FP8 weights are multiplied (`stage_ar.gemv.gemv`'s ``fp8_compute``).
FP8_COMPUTES = ("activation", "float16", "float16_bits", "fp8")


def check_fp8_compute(fp8_compute: str, x_dtype: torch.dtype) -> None:
    """Raises ValueError unless ``fp8_compute`` is one of `FP8_COMPUTES` and fits ``x_dtype`` (the
    float16 modes take 16-bit activations only)."""
    if fp8_compute not in FP8_COMPUTES:
        raise ValueError(f"fp8_compute must be one of {FP8_COMPUTES}, got {fp8_compute!r}")
    if fp8_compute in ("float16", "float16_bits") and x_dtype == torch.float32:
        raise ValueError(f"fp8_compute={fp8_compute!r} takes 16-bit activations (float32 ones would be rounded)")


def check_gemv_args(x, weight, weight_scale, bias, norm_weight, residual, swiglu,
                    cos=None, sin=None, rope_columns=0, x_scales=None, activation_dtype=None) -> int:
    """Validate `stage_ar.gemv.gemv`'s arguments (its docstring states the rules); returns N, the
    output width. ``x_scales`` and ``activation_dtype``: ``x`` holds E4M3 codes of rows quantized
    already (`stage_ar.fp8_activations.QuantizedRows`) with those ``(M,)`` float32 scales, standing for
    rows of ``activation_dtype`` (the dtype the other arguments and the output take).

    Raises:
        ValueError: shapes, strides, devices or flag combinations that do not fit.
        TypeError: dtypes that do not fit.
    """
    if x.ndim != 2 or weight.ndim != 2:
        raise ValueError(f"gemv takes 2-D x (M, K) and weight (R, K), got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to at most {MAX_ROWS} rows, got M = {m} (use torch.nn.functional.linear)")
    dtype = x.dtype if x_scales is None else activation_dtype
    if x_scales is not None:
        if x.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
            raise TypeError(f"quantized rows are {FP8_DTYPE} codes for {FP8_DTYPE} weights, got {x.dtype} and "
                            f"{weight.dtype}")
        expect_tensor("x_scales", x_scales, (m,), torch.float32, x.device)
        if norm_weight is not None:
            raise ValueError("quantized rows are normalised already: no norm_weight")
    if dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"x dtype {dtype} is not one of {ACTIVATION_DTYPES}")
    if weight.dtype not in (dtype, FP8_DTYPE):
        raise TypeError(f"weight dtype {weight.dtype} must be x's ({dtype}) or {FP8_DTYPE}")
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} columns, x has K = {k}")
    if not weight.is_contiguous() or x.stride(1) != 1:
        raise ValueError("gemv needs a contiguous weight and x rows contiguous (x.stride(1) == 1)")
    rows = weight.shape[0]
    if weight.numel() >= 2**31:
        raise ValueError(f"weight {tuple(weight.shape)} has 2^31 elements or more (32-bit offsets)")
    if swiglu and rows % 2:
        raise ValueError(f"swiglu needs gate and up rows stacked, (2 * N, K); got {rows} rows")
    n = rows // 2 if swiglu else rows
    if (weight.dtype == FP8_DTYPE) != (weight_scale is not None):
        raise ValueError("weight_scale is required with float8_e4m3fn weights and only with them")
    if weight_scale is not None:
        if weight_scale.dtype != torch.float32:
            raise TypeError(f"weight_scale must be float32, got {weight_scale.dtype}")
        expect_tensor("weight_scale", weight_scale, (rows,), torch.float32, x.device)
    if bias is not None:
        expect_tensor("bias", bias, (rows,), dtype, x.device)
    if norm_weight is not None:
        expect_tensor("norm_weight", norm_weight, (k,), dtype, x.device)
    if residual is not None:
        expect_tensor("residual", residual, (m, n), dtype, x.device)
        if residual.stride(1) != 1:
            raise ValueError("residual rows must be contiguous (residual.stride(1) == 1)")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    _check_rope(x, dtype, n, swiglu, residual, cos, sin, rope_columns)
    return n


def _check_rope(x, dtype, n, swiglu, residual, cos, sin, rope_columns) -> None:
    """The RoPE epilogue's arguments: ``cos``/``sin`` both or neither, ``(M, head_dim)`` contiguous in
    ``dtype``, ``head_dim`` even and dividing N and ``rope_columns``; not with swiglu/residual."""
    if (cos is None) != (sin is None):
        raise ValueError("the RoPE epilogue takes cos and sin together")
    if cos is None:
        if rope_columns:
            raise ValueError(f"rope_columns={rope_columns} without cos and sin")
        return
    if swiglu or residual is not None:
        raise ValueError("the RoPE epilogue does not combine with swiglu or residual")
    head_dim = cos.shape[-1] if cos.ndim == 2 else 0
    for name, t in (("cos", cos), ("sin", sin)):
        expect_tensor(name, t, (x.shape[0], head_dim), dtype, x.device)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if head_dim < 2 or head_dim % 2 or n % head_dim:
        raise ValueError(f"RoPE needs an even head_dim dividing N = {n}, got head_dim {head_dim}")
    if not 0 <= rope_columns <= n or rope_columns % head_dim:
        raise ValueError(f"rope_columns must be a multiple of head_dim {head_dim} in [0, {n}], got {rope_columns}")


def expect_tensor(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """Raise unless ``t`` has ``shape``, ``dtype`` and ``device`` (and, when 1-D, is contiguous).

    Raises:
        ValueError: shape, device or stride; TypeError: dtype.
    """
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name} dtype must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, x on {device}")
    if t.ndim == 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")
