"""Layers shared by the MammothModa2 DiT models (`transformer_mammoth.py`, `condition_refiner.py`).

Only small, standard building blocks live here: an RMSNorm with Qwen2's numerics, the SwiGLU
feed-forward of Lumina2, the real-valued interleaved rotary embedding and a masked attention helper.
Attribute names equal the upstream checkpoint keys (`weight`, `linear_1`, `linear_2`, `linear_3`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm with Qwen2's numerics (upstream `Qwen2RMSNorm`).

    The statistic is computed in float32, the normalised value is cast back to the input dtype and
    only then multiplied by `weight` (so a bfloat16 input with bfloat16 weight stays bfloat16).

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square before the reciprocal square root.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states (`torch.Tensor` of shape `(..., hidden_size)`) -> same shape and dtype."""
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def swiglu_inner_dim(inner_dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Hidden width of the Lumina2 SwiGLU FFN.

    `int(ffn_dim_multiplier * inner_dim)` when a multiplier is given, then rounded *up* to a multiple of
    `multiple_of` (upstream `LuminaFeedForward`). Example: dim 64, inner 4*64, multiplier 0.5,
    multiple_of 32 -> 128.
    """
    if ffn_dim_multiplier is not None:
        inner_dim = int(ffn_dim_multiplier * inner_dim)
    return multiple_of * ((inner_dim + multiple_of - 1) // multiple_of)


class SwiGLUFeedForward(nn.Module):
    """Lumina2 feed-forward: `linear_2(silu(linear_1 x) * linear_3 x)`, all without bias.

    The SiLU is evaluated in float32 and cast back (upstream `_swiglu`).

    Args:
        dim: input and output width.
        inner_dim: nominal hidden width before `swiglu_inner_dim` applies the multiplier and rounding.
        multiple_of: rounding granularity of the hidden width.
        ffn_dim_multiplier: optional scale of `inner_dim`.
    """

    def __init__(
        self, dim: int, inner_dim: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None
    ) -> None:
        super().__init__()
        hidden = swiglu_inner_dim(inner_dim, multiple_of, ffn_dim_multiplier)
        self.linear_1 = nn.Linear(dim, hidden, bias=False)
        self.linear_2 = nn.Linear(hidden, dim, bias=False)
        self.linear_3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (`torch.Tensor` of shape `(..., dim)`) -> `(..., dim)`."""
        gate = self.linear_1(x)
        gate = F.silu(gate.float()).to(gate.dtype)
        return self.linear_2(gate * self.linear_3(x))


def rotary_axis_table(dim: int, length: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos/sin table of one RoPE axis, each frequency repeated for an adjacent pair.

    Built like upstream `get_1d_rotary_pos_embed_real`: frequencies `theta ** -(2k/dim)` and the angles
    `pos * freq` in float64 on the CPU, then cos/sin cast to float32 and interleaved
    (`[c0, c0, c1, c1, ...]`).

    Returns:
        `(cos, sin)`, each float32 of shape `(length, dim)`.

    Raises:
        ValueError: if `dim` is odd.
    """
    if dim % 2:
        raise ValueError(f"rotary axis dim must be even, got {dim}")
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    angles = torch.outer(torch.arange(length, device="cpu"), freqs)
    cos = angles.cos().repeat_interleave(2, dim=1).float()
    sin = angles.sin().repeat_interleave(2, dim=1).float()
    return cos, sin


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs `(x[2k], x[2k+1])` by the angles whose cos/sin are given.

    `out[2k] = x[2k] cos - x[2k+1] sin`, `out[2k+1] = x[2k] sin + x[2k+1] cos` (upstream
    `apply_real_rotary_emb`). Computed in float32, returned in `x.dtype`.

    Args:
        x: `(batch, seq, heads, head_dim)`.
        cos, sin: float32 `(batch, seq, head_dim)` (interleaved, see `rotary_axis_table`).
    """
    b, s, h, d = x.shape
    pairs = x.float().view(b, s, h, d // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    c = cos.view(b, s, 1, d // 2, 2)[..., 0]
    sn = sin.view(b, s, 1, d // 2, 2)[..., 0]
    out = torch.stack([x1 * c - x2 * sn, x1 * sn + x2 * c], dim=-1)
    return out.view(b, s, h, d).to(x.dtype)


def masked_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None
) -> torch.Tensor:
    """Bidirectional scaled-dot-product attention with a key padding mask and grouped KV heads.

    KV head `j // (heads / kv_heads)` serves query head `j` (`repeat_interleave`, as upstream). The
    softmax scale is `1/sqrt(head_dim)`. A batch element whose keys are all masked attends to all of
    them instead (its rows are padding and are discarded by the caller; this only keeps them finite).

    Args:
        query: `(batch, seq_q, heads, head_dim)`.
        key, value: `(batch, seq_k, kv_heads, head_dim)`.
        key_mask: bool `(batch, seq_k)`, True = attend; None = no padding.

    Returns:
        `(batch, seq_q, heads * head_dim)` in `query.dtype`.
    """
    b, sq, heads, d = query.shape
    if sq == 0 or key.shape[1] == 0:
        return query.new_zeros(b, sq, heads * d)
    groups = heads // key.shape[2]
    q = query.transpose(1, 2)
    k = key.transpose(1, 2).repeat_interleave(groups, dim=1)
    v = value.transpose(1, 2).repeat_interleave(groups, dim=1)
    attn_mask = None
    if key_mask is not None:
        key_mask = key_mask.to(torch.bool)
        key_mask = key_mask | ~key_mask.any(dim=-1, keepdim=True)
        attn_mask = key_mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1.0 / math.sqrt(d))
    return out.transpose(1, 2).reshape(b, sq, heads * d)
