"""Attention backends of the one AR forward (`MammothARForCausalLM.forward`'s ``attention`` argument).

Every backend takes one layer's rotated queries ``(B, T, heads, d)`` and new keys/values
``(B, T, kv_heads, d)``, stores the keys/values in its cache and returns ``(B, T, heads * d)``:

* `SDPAAttention` — prefill and per-sequence decode: appends to a `KVCache` (or none: a full
  forward) and runs ``scaled_dot_product_attention`` with a bool ``(B, 1, T, S)`` mask.
* `GEMMDecodeAttention` — one new token per pool slot ``[0, b)``: the key/value written at each row's
  own position, attention as two batched GEMMs over the first ``length`` positions with a float32
  softmax (the CPU batched path, and CUDA without Triton).
* `TritonDecodeAttention` — the same contract through the split-KV Triton kernel with the KV write
  fused in (`stage_ar.decode_attention`, batch-invariant by construction; CUDA).
* `WindowGEMMAttention` / `TritonWindowAttention` — ``T`` causal query positions per row (a Jacobi
  window, `stage_ar.jacobi`) in given pool slots: two GEMMs and a float32 softmax, or the split-KV
  kernel's multi-query variant (`stage_ar.decode_attention.window_attention`, KV write fused).

The decode backends are built once per step (their masks/positions are shared by every layer) and
capture cleanly into a CUDA graph: no host synchronisation.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch
import torch.nn.functional as F

from stage_ar import decode_attention as triton_decode
from stage_ar.layers import EAGER_OPS, PointwiseOps

__all__ = ["AttentionBackend", "GEMMDecodeAttention", "SDPAAttention", "TritonDecodeAttention", "TritonWindowAttention",
           "WindowGEMMAttention", "build_attention_mask"]


class AttentionBackend(Protocol):
    """``forward(layer, q (B,T,H,d), k (B,T,KV,d), v (B,T,KV,d)) -> (B, T, H*d)``. A backend whose
    ``gathers_amax`` attribute is True also takes ``amax_out=`` (`TritonDecodeAttention`: each output
    row's amax for a W8A8 o_proj, `stage_ar.fp8_activations.RowsWithAmax`)."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def build_attention_mask(
    attention_mask: torch.Tensor | None, batch: int, seq: int, past: int, device: torch.device
) -> torch.Tensor:
    """Bool ``(batch, 1, T, S)`` mask (True = attend), ``S = past + T``.

    ``attention_mask`` may be ``None`` (causal), a key mask ``(batch, S)`` (1/True = real token,
    combined with causality), or a ready ``(batch, 1, T, S)`` bool or additive float mask.
    Every query may always attend to its own position, so a fully padded query row yields
    finite values instead of NaN; such rows are padding and never read.

    Raises:
        ValueError: a mask of the wrong shape or rank.
    """
    total = past + seq
    q_pos = torch.arange(past, total, device=device)
    k_pos = torch.arange(total, device=device)
    causal = (k_pos[None, :] <= q_pos[:, None])[None, None]  # (1,1,T,S)
    if attention_mask is None:
        mask = causal.expand(batch, 1, seq, total)
    elif attention_mask.dim() == 2:
        if tuple(attention_mask.shape) != (batch, total):
            raise ValueError(
                f"key attention_mask must be (batch, past+T) = {(batch, total)}, got {tuple(attention_mask.shape)}")
        mask = causal & attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    elif attention_mask.dim() == 4:
        if tuple(attention_mask.shape[-2:]) != (seq, total):
            raise ValueError(
                f"4-D attention_mask must end in (T, S) = {(seq, total)}, got {tuple(attention_mask.shape)}")
        full = attention_mask.to(device)
        mask = full if full.dtype == torch.bool else full > torch.finfo(full.dtype).min / 2
        mask = mask.expand(batch, 1, seq, total)
    else:
        raise ValueError(f"attention_mask must be 2-D or 4-D, got {attention_mask.dim()}-D")
    diagonal = (k_pos[None, :] == q_pos[:, None])[None, None]
    return mask | diagonal


class SDPAAttention:
    """Dense attention over a per-sequence `KVCache` (or the forward's own keys when ``kv_cache`` is
    None), mask from `build_attention_mask`; GQA by repeating the KV heads."""

    def __init__(self, kv_cache, mask: torch.Tensor, scale: float) -> None:
        self.kv_cache, self.mask, self.scale = kv_cache, mask, scale

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t, heads, d = q.shape
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.kv_cache is not None:
            k, v = self.kv_cache.write(layer, k, v)
        groups = heads // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=self.scale)
        return out.transpose(1, 2).reshape(b, t, heads * d)


class _SlotDecode:
    """One decode token per pool slot ``i < b``: slot ``i`` attends to key positions
    ``[key_start[i], pos[i]]``, ``pos[i] < length``; key/value pool tensors
    ``(layers, slots, kv_heads, capacity, d)`` (`stage_ar.kv_pool.KVPool`)."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, pos: torch.Tensor, key_start: torch.Tensor,
                 length: int, scale: float) -> None:
        self.key, self.value, self.pos, self.key_start = key, value, pos, key_start
        self.length, self.scale = length, scale


class GEMMDecodeAttention(_SlotDecode):
    """Decode attention as two batched GEMMs (a KV head's query heads are the M rows); scores in the
    model dtype, softmax in float32 (as transformers' eager attention). cuDNN/flash SDPA here runs one
    CTA per (row, KV head) over the whole pool width, far below the memory bandwidth
    (docs/PERFORMANCE.md)."""

    def __init__(self, *args, ops: PointwiseOps = EAGER_OPS, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ops = ops
        b = self.pos.shape[0]
        k_idx = torch.arange(self.length, device=self.pos.device)
        valid = (k_idx[None, :] >= self.key_start[:, None]) & (k_idx[None, :] <= self.pos[:, None])
        # additive float32 bias (0 / -inf), shared by every layer of the step: (b, 1, 1, length)
        self.bias = torch.zeros(valid.shape, device=valid.device, dtype=torch.float32).masked_fill(
            ~valid, float("-inf"))[:, None, None, :]
        self.rows = torch.arange(b, device=self.pos.device)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, _, heads, d = q.shape
        kv_heads = k.shape[2]
        key_l, value_l = self.key[layer], self.value[layer]
        key_l[self.rows, :, self.pos] = k[:, 0]
        value_l[self.rows, :, self.pos] = v[:, 0]
        keys, values = key_l[:b, :, : self.length], value_l[:b, :, : self.length]
        qg = q[:, 0].reshape(b, kv_heads, heads // kv_heads, d)
        probs = self.ops.masked_softmax(torch.matmul(qg, keys.transpose(-1, -2)), self.scale, self.bias)
        return torch.matmul(probs, values).reshape(b, 1, heads * d)


class TritonDecodeAttention(_SlotDecode):
    """`stage_ar.decode_attention.decode_attention` (split-KV, KV write fused) per layer; ``live``:
    ``(b,)`` bool, the rows to compute (the others write no key/value and return zeros); ``rows``:
    launch only rows ``[0, rows)`` (the served step's live bucket; the rest unspecified), or None."""

    def __init__(self, *args, live: torch.Tensor | None = None, rows: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.live = live
        self.rows = rows

    @staticmethod
    def available(device: torch.device) -> bool:
        """Whether the kernel can run on ``device`` (CUDA with triton, or Triton's interpreter)."""
        return triton_decode.available(device)

    #: takes ``amax_out`` (`AttentionBackend`)
    gathers_amax = True
    #: row ``i`` of the forward is pool slot ``i`` in every step (`stage_ar.modeling_mammoth_ar.rows_are_slots`)
    rows_are_slots = True

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                amax_out: torch.Tensor | None = None, delayed_out=None):
        """``(b, 1, heads * d)``; ``amax_out``, ``delayed_out``: `stage_ar.decode_attention.decode_attention`'s
        (with ``delayed_out``, ``(that, DelayedRows of that view shape)``)."""
        b, _, heads, d = q.shape
        out = triton_decode.decode_attention(q[:, 0], k[:, 0], v[:, 0], self.key[layer], self.value[layer],
                                             self.pos, self.key_start, self.length, self.scale, live=self.live,
                                             amax_out=amax_out, rows=self.rows, delayed_out=delayed_out)
        if delayed_out is None:
            return out.view(b, 1, heads * d)
        out, codes = out
        return out.view(b, 1, heads * d), dataclasses.replace(codes, view_shape=torch.Size((b, 1, heads * d)))


class WindowGEMMAttention:
    """``T`` query positions per row (a Jacobi window): row ``i`` lives in pool slot ``slots[i]``,
    writes its keys/values at positions ``pos[i] + t`` and query ``t`` attends to key positions
    ``[key_start[i], pos[i] + t]`` (causal inside the window), ``pos[i] + T <= length``. Two batched
    GEMMs and a float32 softmax, as `GEMMDecodeAttention` (CPU, and CUDA without Triton;
    `TritonWindowAttention` is the split-KV kernel's path).

    Args:
        key, value: pool tensors ``(layers, slots, kv_heads, capacity, d)``.
        slots, pos, key_start: ``(R,)`` int64 on the pool's device.
        window: ``T``.
        length: key positions read (``max(pos) + T`` at least).
        scale: softmax scale.
    """

    def __init__(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                 key_start: torch.Tensor, window: int, length: int, scale: float,
                 ops: PointwiseOps = EAGER_OPS) -> None:
        self.key, self.value, self.slots, self.scale, self.ops = key, value, slots, scale, ops
        self.length = length
        offsets = torch.arange(window, device=pos.device)
        self.positions = pos[:, None] + offsets[None, :]  # (R, T)
        k_idx = torch.arange(length, device=pos.device)
        valid = (k_idx[None, None, :] >= key_start[:, None, None]) & (k_idx[None, None, :] <= self.positions[..., None])
        # additive float32 bias (0 / -inf), (R, 1, 1, T, length), shared by every layer
        self.bias = torch.zeros(valid.shape, device=pos.device, dtype=torch.float32).masked_fill(
            ~valid, float("-inf"))[:, None, None]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        r, t, heads, d = q.shape
        kv_heads = k.shape[2]
        key_l, value_l = self.key[layer], self.value[layer]
        slot_idx = self.slots[:, None].expand(r, t)
        key_l[slot_idx, :, self.positions] = k
        value_l[slot_idx, :, self.positions] = v
        keys = key_l[self.slots, :, : self.length]  # (R, KV, L, d)
        values = value_l[self.slots, :, : self.length]
        qg = q.permute(0, 2, 1, 3).reshape(r, kv_heads, heads // kv_heads, t, d)
        scores = torch.matmul(qg, keys.transpose(-1, -2)[:, :, None])  # (R, KV, G, T, L)
        probs = self.ops.masked_softmax(scores, self.scale, self.bias)
        out = torch.matmul(probs, values[:, :, None])  # (R, KV, G, T, d)
        return out.reshape(r, heads, t, d).permute(0, 2, 1, 3).reshape(r, t, heads * d)


class TritonWindowAttention:
    """`WindowGEMMAttention`'s contract through `stage_ar.decode_attention.window_attention` (split-KV,
    the window's KV write fused, batch-invariant by construction; CUDA, or Triton's interpreter).
    No host synchronisation: captures into a CUDA graph.

    Args:
        key, value: pool tensors ``(layers, slots, kv_heads, capacity, d)``.
        slots, pos, key_start: ``(R,)`` int64 on the pool's device.
        window: ``T``.
        length: key positions any row may read (``max(pos) + T`` at least; sizes the grid only).
        scale: softmax scale.
    """

    def __init__(self, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
                 key_start: torch.Tensor, window: int, length: int, scale: float) -> None:
        self.key, self.value, self.slots, self.pos, self.key_start = key, value, slots, pos, key_start
        self.window, self.length, self.scale = window, length, scale

    available = staticmethod(TritonDecodeAttention.available)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return triton_decode.window_attention(q, k, v, self.key[layer], self.value[layer], self.slots, self.pos,
                                              self.key_start, self.length, self.scale)
