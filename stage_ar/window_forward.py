"""The verification forward of Jacobi windows (`stage_ar.jacobi`), replayed as CUDA graphs.

`WindowForward` runs the model's one forward over ``R`` rows of ``T`` tokens each (row ``i`` in pool
slot ``slots[i]``, its tokens at cache positions ``pos[i] .. pos[i] + T - 1``, causal inside the
window) and the visual-code logits of every position. The attention backend is the split-KV Triton
kernel's window variant (`stage_ar.attention.TritonWindowAttention`) when the runner's fused
attention is on, else the GEMM path (`stage_ar.attention.WindowGEMMAttention`); the pointwise
kernels are the eager ones (a compiled set would recompile for every window shape).

On CUDA with the runner's ``cuda_graphs`` each shape ``(R, T, key length)`` is captured once, lazily,
at its first use (that call runs eagerly on the persistent inputs, which is also the warm-up, then
captures; capture only records, so the pool is written once) and replayed afterwards: a turn is then
one small host-to-device copy of the row metadata, one device copy of the token ids and one replay.
The graphs, their persistent inputs and outputs and their memory pool belong to this object (and so
to the runner that owns the verifier): `release` drops them, as does dropping the runner. A failed
capture logs a warning and leaves that object eager.

Batch invariance: the graph replays exactly the kernels of the eager call with the same shapes, so a
row's bits are those of the eager forward (the split-KV kernel's rows depend on nothing but their own
metadata; the linear layers on the row count ``R * T``: GEMV up to 16 rows, cuBLAS above).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from stage_ar.attention import TritonWindowAttention, WindowGEMMAttention
from stage_ar.modeling_mammoth_ar import ExpertRouting, MammothARForCausalLM

__all__ = ["WindowForward"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Static:
    """Persistent inputs ``meta (4, R)`` (slots, cache position, RoPE position, first key) and
    ``ids (R, T)``; outputs once captured."""

    meta: torch.Tensor
    ids: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class WindowForward:
    """Window forwards over one runner's model and KV pool (see module doc).

    Args:
        model: the AR model.
        key, value: the pool's tensors ``(layers, slots, kv_heads, capacity, d)``.
        vstart, vend: the visual-code id range (logits of ``[vstart, vend)``).
        scale: softmax scale.
        fused_attention: use the Triton window kernel (else two GEMMs and a float32 softmax).
        cuda_graphs: capture each shape on first use (CUDA only).
    """

    def __init__(self, model: MammothARForCausalLM, key: torch.Tensor, value: torch.Tensor, vstart: int, vend: int,
                 scale: float, *, fused_attention: bool, cuda_graphs: bool) -> None:
        self.model, self.key, self.value = model, key, value
        self.vstart, self.vend, self.scale = vstart, vend, scale
        self.device = key.device
        self.fused_attention = fused_attention
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self._static: dict[tuple[int, int, int], _Static] = {}
        self._pool = None

    @property
    def graphs_captured(self) -> int:
        """Window shapes captured as CUDA graphs so far."""
        return sum(st.graph is not None for st in self._static.values())

    def release(self) -> None:
        """Drop every captured graph, its persistent tensors and the graphs' memory pool."""
        self._static.clear()
        self._pool = None

    def __call__(self, meta: list[list[int]], ids: torch.Tensor, length: int,
                 capture: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over ``R`` windows of ``T`` tokens.

        Args:
            meta: four host lists of ``R`` ints: pool slot, first cache position, first RoPE
                position, first key position of each row.
            ids: ``(R, T)`` int64 token ids on the device (generation ids).
            length: key positions read (``max(pos) + T`` at least; a bucket keeps the shapes few).
            capture: capture this shape if it is new (the verifier captures full windows only: a
                grid's last, shorter windows run eagerly, once per image, instead of adding a graph
                per remainder).

        Returns:
            ``(hidden (R, T, H), logits (R * T, V))``: a private copy of the rows (model dtype) and
            the visual-code logits (float32; valid until the next call).
        """
        r, t = ids.shape
        shape = (r, t, length)
        st = self._static.get(shape)
        if st is None:
            st = _Static(torch.empty(4, r, dtype=torch.long, device=self.device),
                         torch.empty(r, t, dtype=torch.long, device=self.device))
            self._static[shape] = st
        st.meta.copy_(torch.tensor(meta, dtype=torch.long), non_blocking=True)
        st.ids.copy_(ids)
        if st.graph is not None:
            st.graph.replay()
            return st.hidden.clone(), st.logits
        hidden, logits = self._eager(st, length)
        if self.cuda_graphs and capture:
            self._capture(st, length)
        return hidden.clone(), logits

    def _eager(self, st: _Static, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`_forward`, falling back (logged) to the GEMM attention path if the Triton window kernel
        fails (the retry rewrites the same keys/values)."""
        try:
            return self._forward(st, length)
        except Exception as exc:  # noqa: BLE001 - Triton compile/launch failures of many kinds
            if not self.fused_attention:
                raise
            logger.warning("Triton window attention failed (%s: %s); using the GEMM path", type(exc).__name__, exc)
            self.fused_attention = False
            return self._forward(st, length)

    def _forward(self, st: _Static, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots, pos, rope, key_start = st.meta
        r, t = st.ids.shape
        if self.fused_attention:
            attention = TritonWindowAttention(self.key, self.value, slots, pos, key_start, t, length, self.scale)
        else:
            attention = WindowGEMMAttention(self.key, self.value, slots, pos, key_start, t, length, self.scale)
        positions = rope[:, None] + torch.arange(t, device=self.device)[None, :]
        hidden = self.model(st.ids, positions, compute_logits=False, attention=attention,
                            routing=ExpertRouting.all_generation(st.ids)).last_hidden_state
        logits = self.model.compute_logits(hidden.reshape(r * t, -1), self.vstart, self.vend)
        return hidden, logits

    def _capture(self, st: _Static, length: int) -> None:
        """Record `_forward` on ``st``'s tensors (nothing runs; the eager call before was the warm-up)."""
        graph = torch.cuda.CUDAGraph()
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                st.hidden, st.logits = self._forward(st, length)
        except Exception as exc:  # noqa: BLE001 - capture fails in many ways (unsupported ops, drivers)
            logger.warning("CUDA graph capture of the Jacobi window forward failed (%s: %s); running it eagerly",
                           type(exc).__name__, exc)
            self.cuda_graphs = False
            st.hidden = st.logits = None
            return
        st.graph = graph
