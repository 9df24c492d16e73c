"""The one RMSNorm with Qwen2's numerics, shared by the AR (every norm) and the DiT (its base norm).

`rms_norm` defines the arithmetic; `RMSNorm` is the module (checkpoint key ``weight``), with the
residual add fused in when a residual is given (the AR's decoder layers carry the residual stream
separately, as vLLM's Qwen2 does). Kernels are pluggable (``kernels``: any object with ``rms_norm``
and ``add_rms_norm`` attributes, e.g. the AR's `torch.compile`d `PointwiseOps`), so
a compiled variant is these same functions, compiled, not a second definition.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

__all__ = ["RMSNorm", "add_rms_norm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen2 RMSNorm numerics: ``weight * (x / sqrt(mean(x²) + eps))`` with the statistic in float32
    and the normalised value cast back to ``x.dtype`` *before* the weight multiply (as upstream
    ``Qwen2RMSNorm``; matters for bf16 bit-compatibility). ``x (..., hidden)``."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Residual add then `rms_norm`: returns ``(rms_norm(residual + x), residual + x)``."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


_EAGER = SimpleNamespace(rms_norm=rms_norm, add_rms_norm=add_rms_norm)


class RMSNorm(nn.Module):
    """Qwen2 RMSNorm (`rms_norm` numerics), with the residual add fused in when given.

    ``forward(x)`` returns the normalised ``x``; ``forward(x, residual)`` returns
    ``(rms_norm(residual + x), residual + x)``, the new residual stream second. ``x (..., hidden)``.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square before the reciprocal square root.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, kernels: Any = None):
        kernels = kernels or _EAGER
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.variance_epsilon)
        return kernels.add_rms_norm(x, residual, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"
