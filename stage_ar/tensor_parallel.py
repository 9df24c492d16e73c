"""Tensor parallelism for the AR model (issue 21): Megatron-style sharding over a process group.

A loaded `MammothARForCausalLM` is sharded in place across the ``world_size`` ranks of a
``torch.distributed`` process group (NCCL on GPUs, gloo in the CPU tests), one process per GPU:

- ``qkv_proj`` / ``gen_qkv_proj`` (the stacked q, k, v projections) are split by **output**
  (column parallel): each rank keeps its ``num_attention_heads / N`` query heads and
  ``num_key_value_heads / N`` key/value heads (rows of each stacked part, biases with them), so
  attention, RoPE and the KV cache are per rank with no communication;
- ``o_proj`` / ``gen_o_proj`` are split by **input** (row parallel): each rank multiplies its heads'
  columns and one all-reduce (sum) per projection forms the full output (Megatron-LM, Shoeybi et
  al. 2019, section 3: one all-reduce after attention and one after the MLP per layer);
- the MLP's fused ``gate_up_proj`` is split by output (each of gate and up keeps rows
  ``[r * I/N, (r+1) * I/N)``), ``down_proj`` by input with an all-reduce after it.

Embeddings, norms and the two heads stay replicated: each rank then holds the same hidden states
after every layer, every rank samples the same token from the same logits, and only rank 0 needs to
stream rows to the DiT. (The generation head is 1 % of a visual token's weight bytes at Preview
size; vocabulary sharding of the heads would save memory, not decode time.)

Shard **before** any weight conversion (FP8, fused kernels' layouts): the sharder reads and
replaces the modules' ``weight``/``bias`` parameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from mammoth_core.distributed import GroupRank
from stage_ar.configuration_mammoth_ar import MammothARConfig
from stage_ar.modeling_mammoth_ar import MammothARForCausalLM

__all__ = ["RankARConfig", "check_tensor_parallel_size", "shard_ar_model_"]


@dataclass
class RankARConfig(MammothARConfig):
    """A rank's view of the model configuration: its share of the heads and MLP width, the full
    model's ``head_dim`` (which `MammothARConfig` would otherwise derive from the head count).

    KV caches and pools sized from it hold only this rank's key/value heads.
    """

    full_head_dim: int = 0
    tensor_parallel_size: int = 1

    @property
    def head_dim(self) -> int:  # type: ignore[override]
        """The unsharded model's per-head width."""
        return self.full_head_dim


def _rank_config(config: MammothARConfig, tp: GroupRank) -> RankARConfig:
    n = tp.world_size
    kept = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    kept.update(
        num_attention_heads=config.num_attention_heads // n,
        num_key_value_heads=config.num_key_value_heads // n,
        intermediate_size=config.intermediate_size // n,
        full_head_dim=config.head_dim,
        tensor_parallel_size=n,
    )
    return RankARConfig(**kept)


def check_tensor_parallel_size(config: MammothARConfig, n: int) -> None:
    """Raise ValueError unless ``n`` ranks divide the query heads, key/value heads and MLP width."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % n:
            raise ValueError(f"tensor_parallel_size {n} does not divide {name} {value}")


def _rank_rows(t: torch.Tensor, sizes: tuple[int, ...], tp: GroupRank) -> torch.Tensor:
    """Of each consecutive part (``sizes`` rows along dim 0) keep this rank's ``1/N`` share."""
    parts = torch.split(t, list(sizes), dim=0)
    return torch.cat([p.chunk(tp.world_size, dim=0)[tp.rank] for p in parts], dim=0).contiguous()


def _shard_output_(linear: nn.Linear, sizes: tuple[int, ...], tp: GroupRank) -> None:
    """Column parallel: keep this rank's rows of each stacked part of ``weight`` and ``bias``, and of
    the FP8 row scales ``weight_scale`` where the weight is stored as codes (an FP8 checkpoint)."""
    linear.weight = nn.Parameter(_rank_rows(linear.weight.data, sizes, tp), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(_rank_rows(linear.bias.data, sizes, tp), requires_grad=False)
    if getattr(linear, "weight_scale", None) is not None:
        linear.weight_scale = _rank_rows(linear.weight_scale, sizes, tp)
    linear.out_features = linear.weight.shape[0]


def _shard_input_(linear: nn.Linear, tp: GroupRank) -> None:
    """Row parallel: keep this rank's input columns; the partial outputs are summed by a forward
    hook (one all-reduce). A bias would be added ``N`` times, so there must be none. FP8 row scales
    stay whole: each output row's scale multiplies every rank's partial sum alike."""
    if linear.bias is not None:
        raise ValueError("a row-parallel projection with a bias is not supported")
    cols = linear.weight.data.chunk(tp.world_size, dim=1)[tp.rank].contiguous()
    linear.weight = nn.Parameter(cols, requires_grad=False)
    linear.in_features = cols.shape[1]
    linear.register_forward_hook(lambda _module, _inputs, output: tp.all_reduce_(output))


def shard_ar_model_(model: MammothARForCausalLM, tp: GroupRank) -> MammothARForCausalLM:
    """Shard ``model`` in place for ``tp`` (see the module docstring) and return it.

    Every rank must call it on identical weights. Afterwards ``model.config`` is this rank's
    `RankARConfig` (its KV caches hold ``num_key_value_heads / N`` heads) and every forward
    performs two all-reduces per layer over ``tp.group``; outputs equal the unsharded model's up to
    the summation order of the row-parallel products.

    Raises:
        ValueError: ``tp.world_size`` does not divide the query heads, the key/value heads or the
            MLP width, or the model was sharded already.
    """
    config = model.config
    if isinstance(config, RankARConfig):
        raise ValueError("model is sharded already")
    n = tp.world_size
    check_tensor_parallel_size(config, n)
    if n == 1:
        return model
    hd = config.head_dim
    qkv_sizes = (config.num_attention_heads * hd, config.num_key_value_heads * hd, config.num_key_value_heads * hd)
    inter = config.intermediate_size
    for layer in model.language_model.layers:
        attn = layer.self_attn
        for qkv, out in ((attn.qkv_proj, attn.o_proj), (attn.gen_qkv_proj, attn.gen_o_proj)):
            if qkv is not None:
                _shard_output_(qkv, qkv_sizes, tp)
                _shard_input_(out, tp)
        attn.num_heads //= n
        attn.num_key_value_heads //= n
        for mlp in (layer.mlp, layer.gen_mlp):
            if mlp is not None:
                _shard_output_(mlp.gate_up_proj, (inter, inter), tp)
                _shard_input_(mlp.down_proj, tp)
    rank_config = _rank_config(config, tp)
    model.config = rank_config
    model.language_model.config = rank_config
    return model
