"""DiT over several GPUs (issue 21): CFG-parallel and Ulysses sequence-parallel transformer.

Both modes wrap a loaded `MammothTransformer2DModel` in place of the pipeline's ``transformer``;
every rank of the group runs the same pipeline (same request, same noise) and ends with the same
velocity, so every rank's latents stay equal and rank 0 alone encodes and returns the image.

- **CFG-parallel** (`CFGParallelTransformer`, vllm-omni's ``cfg_parallel_size``): the forward's batch
  (the conditional and unconditional branch, or several requests' branches) is split over the ranks;
  each rank runs its rows and one all-gather per step rebuilds the batch. With 2 ranks and one
  guided request, each GPU runs one branch. A batch smaller than the group is padded with copies of
  its last row (computed and dropped).
- **Ulysses** (`enable_ulysses_`, Jacobs et al. 2023, "DeepSpeed Ulysses"): the joint caption+image
  sequence of the main transformer layers is split over the ranks; inside each attention an
  all-to-all trades the sequence split for a head split (every rank then attends over the whole
  sequence for ``heads / N`` heads), and a second all-to-all trades back. Norms, modulation and the
  feed-forward are per token and run on the rank's share only. The refiners (short sequences) and
  the output layer run replicated; the sequence is gathered after the last layer.

Outputs equal the single-process forward up to the summation order of the split GEMMs (float32 on
the CPU tests; bf16 bounds on GPUs are measured in ``benchmarks/``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mammoth_core.distributed import GroupRank
from stage_dit.modules import masked_attention
from stage_dit.transformer_mammoth import MammothTransformer2DModel

__all__ = ["CFGParallelTransformer", "PARALLEL_MODES", "UlyssesAttention", "enable_ulysses_", "parallel_transformer"]


class CFGParallelTransformer(nn.Module):
    """The transformer with its batch split over ``ranks`` (see the module docstring).

    Args:
        transformer: the loaded model (identical weights on every rank).
        ranks: this process's `GroupRank`.

    Same call and result as `MammothTransformer2DModel.forward`: velocity ``(batch, C, h, w)``.
    """

    def __init__(self, transformer: MammothTransformer2DModel, ranks: GroupRank) -> None:
        super().__init__()
        self.inner = transformer
        self.ranks = ranks

    @property
    def config(self):  # noqa: ANN201 - the inner model's diffusers config
        """The wrapped model's config (the pipeline reads ``in_channels`` and ``patch_size``)."""
        return self.inner.config

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        text_hidden_states: torch.Tensor,
        text_attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """See `MammothTransformer2DModel.forward`; this rank computes rows
        ``[rank * k, (rank + 1) * k)`` with ``k = ceil(batch / N)`` and all ranks exchange them."""
        n = self.ranks.world_size
        batch = hidden_states.shape[0]
        if n == 1:
            return self.inner(hidden_states, timestep, text_hidden_states, text_attention_mask)
        per_rank = math.ceil(batch / n)
        rows = [min(self.ranks.rank * per_rank + i, batch - 1) for i in range(per_rank)]
        index = torch.tensor(rows, device=hidden_states.device)
        mask = text_attention_mask.index_select(0, index)
        text = text_hidden_states.index_select(0, index)
        longest = int(mask.sum(dim=1).max()) if mask.numel() else 0  # drop padding no own row needs
        out = self.inner(hidden_states.index_select(0, index), timestep.index_select(0, index),
                         text[:, :longest], mask[:, :longest])
        return self.ranks.all_gather_cat(out, dim=0)[:batch]


class UlyssesAttention:
    """`masked_attention` over a sequence split across ranks: all-to-all (sequence -> heads),
    attention over the whole sequence for this rank's heads, all-to-all back.

    Called as ``(query (B, S/N, H, D), key, value (B, S/N, KV, D), key_mask, key_lengths)`` with
    ``key_lengths`` counted over the whole (gathered) sequence; returns ``(B, S/N, H * D)``.

    Raises:
        ValueError: ``N`` does not divide the query or key/value heads, or a ``key_mask`` is given
            (the sharded layers pass key lengths).
    """

    def __init__(self, ranks: GroupRank) -> None:
        self.ranks = ranks

    def __call__(self, query, key, value, key_mask=None, key_lengths=None) -> torch.Tensor:  # noqa: ANN001
        if key_mask is not None:
            raise ValueError("Ulysses attention takes key_lengths, not a key mask")
        b, s_local, heads, d = query.shape
        q = self.ranks.all_to_all(query, scatter_dim=2, gather_dim=1)  # (B, S, H/N, D)
        k = self.ranks.all_to_all(key, scatter_dim=2, gather_dim=1)
        v = self.ranks.all_to_all(value, scatter_dim=2, gather_dim=1)
        out = masked_attention(q, k, v, None, key_lengths)  # (B, S, H/N * D)
        out = out.view(b, q.shape[1], heads // self.ranks.world_size, d)
        out = self.ranks.all_to_all(out, scatter_dim=1, gather_dim=2)  # (B, S/N, H, D)
        return out.reshape(b, s_local, heads * d)


class _SequenceShard(nn.Module):
    """One main-layer block on this rank's share of the joint sequence. The first block of the
    stack splits the (padded) sequence, the last gathers it; rotary tables arrive whole and are
    sliced here, key lengths arrive per element over the unpadded sequence."""

    def __init__(self, block: nn.Module, ranks: GroupRank, first: bool, last: bool) -> None:
        super().__init__()
        self.block, self.ranks, self.first, self.last = block, ranks, first, last

    def _span(self, full_len: int) -> tuple[int, slice]:
        padded = math.ceil(full_len / self.ranks.world_size) * self.ranks.world_size
        share = padded // self.ranks.world_size
        return padded, slice(self.ranks.rank * share, (self.ranks.rank + 1) * share)

    def forward(self, hidden_states, attention_mask, rotary_emb, temb=None, key_lengths=None):  # noqa: ANN001, ANN201
        if attention_mask is not None:
            raise ValueError("the sequence-parallel layers take key_lengths, not a mask")
        b, full_len = rotary_emb.shape[:2]
        padded, span = self._span(full_len)
        if self.first:
            hidden_states = nn.functional.pad(hidden_states, (0, 0, 0, padded - full_len))[:, span]
        rope = nn.functional.pad(rotary_emb, (0, 0, 0, padded - full_len))[:, span]
        lengths = list(key_lengths) if key_lengths is not None else [full_len] * b
        out = self.block(hidden_states, None, rope, temb, key_lengths=lengths)
        if self.last:
            out = self.ranks.all_gather_cat(out, dim=1)[:, :full_len]
        return out


def enable_ulysses_(transformer: MammothTransformer2DModel, ranks: GroupRank) -> MammothTransformer2DModel:
    """Make ``transformer``'s main layers sequence-parallel over ``ranks`` (in place; returns it).

    Raises:
        ValueError: ``ranks.world_size`` does not divide the attention or key/value heads.
    """
    n = ranks.world_size
    if n == 1:
        return transformer
    layers = transformer.layers
    for block in layers:
        attn = block.attn
        if attn.num_heads % n or attn.num_kv_heads % n:
            raise ValueError(f"{n} ranks do not divide {attn.num_heads} heads / {attn.num_kv_heads} kv heads")
        attn.attention_backend = UlyssesAttention(ranks)
    transformer.layers = nn.ModuleList(
        _SequenceShard(block, ranks, first=i == 0, last=i == len(layers) - 1) for i, block in enumerate(layers)
    )
    return transformer


#: ``dit_parallel`` modes with several ranks (`mammoth_core.settings.DIT_PARALLEL_MODES` minus ``none``).
PARALLEL_MODES = ("cfg", "ulysses")


def parallel_transformer(transformer: MammothTransformer2DModel, mode: str, ranks: GroupRank) -> nn.Module:
    """``transformer`` made ``mode``-parallel over ``ranks``: a `CFGParallelTransformer` around it
    (``cfg``) or its main layers sequence-parallel (``ulysses``, in place).

    Raises:
        ValueError: an unknown mode, or one the model's heads do not allow (`enable_ulysses_`).
    """
    if mode == "cfg":
        return CFGParallelTransformer(transformer, ranks)
    if mode == "ulysses":
        return enable_ulysses_(transformer, ranks)
    raise ValueError(f"dit_parallel must be one of {PARALLEL_MODES}, got {mode!r}")
