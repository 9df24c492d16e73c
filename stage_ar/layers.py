"""The AR model's pointwise building blocks, each defined once: RoPE of a fused q/k/v block, SwiGLU
of a fused gate/up block, the decode softmax; the Qwen2 RMSNorm (residual add fused in) is the
shared `mammoth_core.norms.RMSNorm`.

`PointwiseOps` bundles them so one model forward can run them eagerly (prefill, the B=1 reference,
CPU) or as `torch.compile`d kernels (the CUDA decode step, `compiled_ops`) without a second copy of
the arithmetic: the compiled ops are these very functions, compiled.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F

from mammoth_core.norms import RMSNorm, add_rms_norm, rms_norm
from stage_ar import launch_overlap

__all__ = [
    "EAGER_OPS", "PointwiseOps", "RMSNorm", "add_rms_norm", "apply_rope", "compiled_ops", "masked_softmax",
    "rms_norm", "rope_qkv", "rotate_half", "silu_and_mul", "split_qkv",
]

logger = logging.getLogger(__name__)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dim: ``[x1, x2] -> [-x2, x1]`` (Qwen/Llama RoPE layout)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The RoPE rule: ``x * cos + rotate_half(x) * sin`` over the last dim (``x (..., d)``, ``cos``/``sin``
    broadcasting to it), each product and the sum in ``x``'s dtype (the GEMV's RoPE epilogue,
    `stage_ar.gemv`, rounds the same way)."""
    return x * cos + rotate_half(x) * sin


def split_qkv(qkv: torch.Tensor, heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of a fused q/k/v block ``(B, T, (heads + 2 kv_heads) * d)``: q ``(B, T, heads, d)``, k and
    v ``(B, T, kv_heads, d)``."""
    b, t, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    q_out, kv_out = heads * d, kv_heads * d
    q = qkv[..., :q_out].view(b, t, heads, d)
    k = qkv[..., q_out : q_out + kv_out].view(b, t, kv_heads, d)
    v = qkv[..., q_out + kv_out :].view(b, t, kv_heads, d)
    return q, k, v


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int):
    """Split a fused q/k/v block ``(B, T, (heads + 2 kv_heads) * d)`` and rotate q and k.

    ``cos``/``sin``: ``(B, T, d)``. Returns q ``(B, T, heads, d)``, k and v ``(B, T, kv_heads, d)``
    (v a view of ``qkv``).
    """
    q, k, v = split_qkv(qkv, heads, kv_heads)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation of a fused ``[gate | up]`` block ``(..., 2 I)``: ``silu(gate) * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def masked_softmax(scores: torch.Tensor, scale: float, bias: torch.Tensor) -> torch.Tensor:
    """``softmax(scores * scale + bias)`` in float32, cast back to the scores' dtype."""
    return torch.softmax(scores.float() * scale + bias, dim=-1).to(scores.dtype)


@dataclasses.dataclass(frozen=True)
class PointwiseOps:
    """The pointwise functions one forward uses (eager or compiled versions of the ones above)."""

    rms_norm: Callable = rms_norm
    add_rms_norm: Callable = add_rms_norm
    rope_qkv: Callable = rope_qkv
    silu_and_mul: Callable = silu_and_mul
    masked_softmax: Callable = masked_softmax
    compiled: bool = False


EAGER_OPS = PointwiseOps()
_COMPILED: PointwiseOps | None = None


def compiled_ops() -> PointwiseOps:
    """`torch.compile`d `PointwiseOps` (built once per process, shared by runners).

    Inductor default mode (no CUDA graphs of its own: the runner captures the whole step), split
    reductions requested off, programmatic dependent launch on where this torch's Inductor offers
    it and `stage_ar.launch_overlap.MODE` is not ``"off"`` (on sm_90+ Inductor then emits it). Inductor still generates per-shape kernels, so in bucket mode a row's
    reduction order may depend on the batch bucket; ``pad_to_max_bucket`` (one shape) stays
    batch-invariant.
    """
    global _COMPILED  # noqa: PLW0603 - one compile cache per process
    if _COMPILED is None:
        opts: dict[str, Any] | None = None
        wanted: dict[str, Any] = {"split_reductions": False}
        if launch_overlap.MODE != "off":  # PDL for Inductor's kernels too, where this torch has it
            wanted["triton.enable_pdl"] = True
        for name, value in wanted.items():
            try:
                torch.compile(silu_and_mul, options={**(opts or {}), name: value})  # validates the names
            except Exception:  # noqa: BLE001 - an Inductor without that option
                continue
            opts = {**(opts or {}), name: value}
        names = ("rms_norm", "add_rms_norm", "rope_qkv", "silu_and_mul", "masked_softmax")
        _COMPILED = PointwiseOps(**{n: torch.compile(getattr(EAGER_OPS, n), options=opts) for n in names},
                                 compiled=True)
    return _COMPILED
