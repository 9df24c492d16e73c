"""Layers shared by the MammothModa2 DiT models (`transformer_mammoth.py`, `condition_refiner.py`).

Only small, standard building blocks live here: the shared Qwen2 RMSNorm with a fused CUDA kernel,
the adaLN pieces (`RMSNormZero`, `LayerNormContinuous`),
the SwiGLU feed-forward of Lumina2, the real-valued interleaved rotary embedding and a masked attention helper.
Attribute names equal the upstream checkpoint keys (`weight`, `linear_1`, `linear_2`, `linear_3`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from mammoth_core.norms import RMSNorm as Qwen2RMSNorm
from stage_dit import fused

#: Row counts of every GEMM in the DiT forward are padded to a multiple of this. MKL's CPU sgemm
#: gives each row the same bits at any row count that is a multiple of it (any thread count, for
#: every linear shape of the DiT: `tests/unit/test_dit_batching.py`); below, it takes other kernels
#: whose sums round differently, and where that stops depends on the CPU and on K: 4 rows sufficed on
#: the CI hosts until 2026-12-03, a Xeon with AMX differs at 4 rows for K = 128 and at 8 for K = 256
#: (2026-12-06), so 16. With it a request's rows do not depend on what else is in the batch. On the
#: GPU the padding costs little: at most 15 rows on thousands of image patches or on a caption.
ROW_QUANTUM = 16


def round_up(n: int, quantum: int = ROW_QUANTUM) -> int:
    """Smallest multiple of ``quantum`` that is >= ``n`` (0 stays 0)."""
    return -(-int(n) // quantum) * quantum


def pad_rows(x: torch.Tensor, rows: int, dim: int = 0) -> torch.Tensor:
    """``x`` zero-padded along ``dim`` to ``rows`` entries (returned as is when it has them)."""
    missing = rows - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def right_padded_lengths(mask: torch.Tensor, name: str = "mask") -> list[int]:
    """Real rows per element of a right-padded `(batch, len)` mask (True = real), read to the host
    with one sync.

    Raises:
        ValueError: if a row is not right-padded (a real entry after a padding one).
    """
    mask = mask.to(torch.bool)
    lengths = mask.sum(dim=1)
    arange = torch.arange(mask.shape[1], device=mask.device)
    not_right_padded = (mask != (arange[None, :] < lengths[:, None])).any()
    host = torch.cat([not_right_padded.reshape(1).long(), lengths.long()]).tolist()
    if host[0]:
        raise ValueError(f"{name} must be right-padded (real rows first)")
    return [int(n) for n in host[1:]]


class RMSNorm(Qwen2RMSNorm):
    """The shared Qwen2-numerics `mammoth_core.norms.RMSNorm` (statistic in float32, normalised
    value cast back to the input dtype, then the weight multiply), except on CUDA with a 16-bit
    input and weight: there one fused `F.rms_norm` kernel (statistic in float32, one rounding of
    ``x * rstd * weight`` instead of two), the DiT's own numerics on the GPU.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square before the reciprocal square root.
    """

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """hidden_states (`torch.Tensor` of shape `(..., hidden_size)`) -> same shape and dtype."""
        input_dtype = hidden_states.dtype
        if hidden_states.is_cuda and input_dtype in (torch.bfloat16, torch.float16) and self.weight.dtype == input_dtype:
            return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.variance_epsilon)
        return super().forward(hidden_states)


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
        """x (`torch.Tensor` of shape `(..., dim)`) -> `(..., dim)`.

        `F.silu` on a 16-bit tensor computes in float32 and rounds once, which is exactly upstream's
        `silu(gate.float()).to(dtype)` without the float32 round trip through memory.
        """
        if fused.enabled(x):  # one kernel for silu * mul (`stage_dit.fused`)
            return self.linear_2(fused.silu_mul(self.linear_1(x), self.linear_3(x)))
        return self.linear_2(F.silu(self.linear_1(x)) * self.linear_3(x))


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


def rotary_complex(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved float32 `(cos, sin)` `(..., head_dim)` -> complex64 `(..., head_dim / 2)` rotations
    `cos_k + i sin_k` (one per adjacent pair), the form `apply_rotary_emb_complex` takes."""
    return torch.complex(cos[..., 0::2].contiguous(), sin[..., 0::2].contiguous())


def apply_rotary_emb_complex(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_emb` with the pair rotation as one complex multiply (3 kernels instead of ~10).

    The pair `(x[2k], x[2k+1])` is read as `x[2k] + i x[2k+1]` and multiplied by `cos_k + i sin_k`:
    real part `x[2k] cos - x[2k+1] sin`, imaginary part `x[2k] sin + x[2k+1] cos` (the same
    formula, float32 arithmetic).

    Args:
        x: `(batch, seq, heads, head_dim)`, any float dtype.
        freqs: complex64 `(batch, seq, head_dim / 2)` from `rotary_complex`.

    Returns:
        `(batch, seq, heads, head_dim)` in `x.dtype`.
    """
    b, s, h, d = x.shape
    pairs = torch.view_as_complex(x.float().reshape(b, s, h, d // 2, 2))
    out = torch.view_as_real(pairs * freqs[:, :, None, :])
    return out.reshape(b, s, h, d).to(x.dtype)


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_mask: torch.Tensor | None,
    key_lengths: Sequence[int] | None = None,
) -> torch.Tensor:
    """Bidirectional scaled-dot-product attention with key padding and grouped KV heads.

    KV head `j // (heads / kv_heads)` serves query head `j` (as upstream's `repeat_interleave`). The
    softmax scale is `1/sqrt(head_dim)`. A batch element whose keys are all masked attends to all of
    them instead (its rows are padding and are discarded by the caller; this only keeps them finite).

    Padding can be given two ways. `key_lengths` (host ints, right padding: element i's real keys are
    its first `key_lengths[i]`) runs one unmasked SDPA call per distinct length over the real keys
    only, which lets CUDA use the flash kernel with native GQA; every query row (padding rows too)
    gets exactly what the masked form gives it. `key_mask` (any pattern) runs one masked call (the
    memory-efficient or math kernel on CUDA). `key_lengths` wins when both are given.

    Args:
        query: `(batch, seq_q, heads, head_dim)`.
        key, value: `(batch, seq_k, kv_heads, head_dim)`.
        key_mask: bool `(batch, seq_k)`, True = attend; None = no padding.
        key_lengths: real key count per element (right padding), or None.

    Returns:
        `(batch, seq_q, heads * head_dim)` in `query.dtype`.

    Raises:
        ValueError: if `key_lengths` does not have one entry per batch element.
    """
    b, sq, heads, d = query.shape
    sk = key.shape[1]
    if sq == 0 or sk == 0:
        return query.new_zeros(b, sq, heads * d)
    groups = heads // key.shape[2]
    scale = 1.0 / math.sqrt(d)
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    if key_lengths is not None:
        if len(key_lengths) != b:
            raise ValueError(f"key_lengths has {len(key_lengths)} entries for batch {b}")
        out = _attention_by_lengths(q, k, v, key_lengths, groups, scale)
        return out.transpose(1, 2).reshape(b, sq, heads * d)
    attn_mask = None
    if key_mask is not None:
        key_mask = key_mask.to(torch.bool)
        key_mask = key_mask | ~key_mask.any(dim=-1, keepdim=True)
        attn_mask = key_mask[:, None, None, :]
        # the masked kernels have no native GQA: expand the KV heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    else:
        out = _sdpa(q, k, v, groups, scale)
    return out.transpose(1, 2).reshape(b, sq, heads * d)


def _attention_by_lengths(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_lengths: Sequence[int],
                          groups: int, scale: float) -> torch.Tensor:
    """`masked_attention`'s right-padding path over ``(b, heads, s, d)`` tensors: one unmasked SDPA
    call per run of consecutive elements with the same key length (element ``i`` attends over its
    first ``key_lengths[i]`` keys; 0 or fewer = all keys), each over a slice (no gathers); returns
    ``(b, heads, s_q, d)`` laid out as ``(b, s_q, heads, d)`` (the caller's reshape is a view)."""
    b, heads, sq, d = q.shape
    sk = k.shape[2]
    lengths = [sk if n <= 0 else min(int(n), sk) for n in key_lengths]  # all masked -> all keys
    if all(n == sk for n in lengths):
        return _sdpa(q, k, v, groups, scale)
    if all(n == lengths[0] for n in lengths):
        return _sdpa(q, k[:, :, : lengths[0]], v[:, :, : lengths[0]], groups, scale)
    out = q.new_empty(b, sq, heads, d).transpose(1, 2)
    start = 0
    while start < b:
        stop, n = start + 1, lengths[start]
        while stop < b and lengths[stop] == n:
            stop += 1
        out[start:stop] = _sdpa(q[start:stop], k[start:stop, :, :n], v[start:stop, :, :n], groups, scale)
        start = stop
    return out


#: SDPA backends the CUDA path asks for, in priority order (`torch.nn.attention.SDPBackend` members);
#: None = PyTorch's own choice. `benchmarks/dit_step.py` measures the candidates for head_dim 96.
SDPA_BACKENDS: list | None = None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, scale: float) -> torch.Tensor:
    """Unmasked SDPA over `(b, heads, s, d)` queries and `(b, kv_heads, s_k, d)` keys/values.

    CUDA: native GQA (`enable_gqa`), backends `SDPA_BACKENDS`. CPU: the KV heads expanded first (the
    reference path).
    """
    if q.is_cuda:
        if SDPA_BACKENDS is None:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=groups > 1)
        with sdpa_kernel(SDPA_BACKENDS, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=groups > 1)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


class RMSNormZero(nn.Module):
    """adaLN for a modulated block (upstream `LuminaRMSNormZero`): keys `linear`, `norm`.

    `scale_msa, gate_msa, scale_mlp, gate_mlp = linear(silu(temb)).chunk(4)`; returns
    `(norm(x) * (1 + scale_msa), gate_msa, scale_mlp, gate_mlp)`.
    """

    def __init__(self, dim: int, temb_dim: int, norm_eps: float) -> None:
        super().__init__()
        self.linear = nn.Linear(temb_dim, 4 * dim, bias=True)
        self.norm = RMSNorm(dim, eps=norm_eps)

    def forward(
        self, x: torch.Tensor, temb: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x `(batch, seq, dim)`, temb `(>= batch, temb_dim)` (rows past `batch` are padding, see
        `modules.ROW_QUANTUM`) -> (`(batch, seq, dim)`, 3 x `(batch, dim)`)."""
        scale_msa, gate_msa, scale_mlp, gate_mlp = self.modulations(temb, x.shape[0])
        return self.norm(x) * (1 + scale_msa[:, None]), gate_msa, scale_mlp, gate_mlp

    def modulations(self, temb: torch.Tensor, batch: int) -> tuple[torch.Tensor, ...]:
        """``(scale_msa, gate_msa, scale_mlp, gate_mlp)``, each `(batch, dim)` (views of one
        `(batch, 4 dim)` GEMM output), from temb `(>= batch, temb_dim)`."""
        return tuple(self.linear(nn.functional.silu(temb))[:batch].chunk(4, dim=1))


class LayerNormContinuous(nn.Module):
    """Output norm (upstream `LuminaLayerNormContinuous`): keys `linear_1`, `linear_2`.

    `linear_2(LayerNorm(x) * (1 + linear_1(silu(temb))))` with a non-affine LayerNorm, eps 1e-6.
    """

    def __init__(self, dim: int, temb_dim: int, out_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(temb_dim, dim, bias=True)
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.linear_2 = nn.Linear(dim, out_dim, bias=True)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """x `(batch, seq, dim)`, temb `(>= batch, temb_dim)` -> `(batch, seq, out_dim)`."""
        scale = self.linear_1(nn.functional.silu(temb).to(x.dtype))[: x.shape[0]]
        return self.linear_2(self.norm(x) * (1 + scale)[:, None, :])
