"""MammothModa2 AR model: a Qwen2.5 text decoder with hard-routed generation experts.

Reference: ``bytedance/mammothmoda`` @ 2317bbce,
``mammothmoda2/model/mammothmoda2_qwen2_5_vl/modeling_mammothmoda2_qwen2_5_vl.py``
(``Qwen2_5_VLTextModel``, ``Qwen2_5_VLAttention``, ``Qwen2_5_VLDecoderLayer``, ``moe_forward``,
``Mammothmoda2Qwen2_5_VLForConditionalGeneration``). Attribute paths equal the checkpoint keys with
the ``llm_model.`` prefix removed, so a strict ``load_state_dict`` needs no renaming. The vision
tower (``model.visual.*``) is not built: text-to-image never runs it.

For text-only inputs the multimodal RoPE positions are ``(t, t, t)``, which makes M-RoPE identical to
plain 1-D RoPE; this module takes 1-D ``position_ids``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stage_ar.configuration_mammoth_ar import MammothARConfig

__all__ = [
    "ARForwardOutput",
    "ExpertRouting",
    "KVCache",
    "MammothARForCausalLM",
    "MammothRMSNorm",
    "strip_llm_prefix",
]

LLM_PREFIX = "llm_model."
VISUAL_PREFIX = "llm_model.model.visual."


def strip_llm_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Select the AR weights of a full MammothModa2 state dict.

    Keeps ``llm_model.*`` keys with the prefix removed and drops the unused vision tower
    (``llm_model.model.visual.*``) and every DiT/VAE/refiner key.
    """
    return {
        key[len(LLM_PREFIX) :]: value
        for key, value in state_dict.items()
        if key.startswith(LLM_PREFIX) and not key.startswith(VISUAL_PREFIX)
    }


class MammothRMSNorm(nn.Module):
    """Qwen2 RMSNorm: ``weight * (x / sqrt(mean(x²) + eps))``, statistics in float32.

    The normalised value is cast back to the input dtype *before* the weight multiply, as upstream
    ``Qwen2RMSNorm`` does (matters for bf16 bit-compatibility).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(input_dtype)


class MammothMLP(nn.Module):
    """SwiGLU feed-forward: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases."""

    def __init__(self, config: MammothARConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class ExpertRouting:
    """Which tokens of one forward go to the generation experts, computed once per forward.

    Attributes:
        gen_token_mask: bool ``(batch, seq)``, True for ids ``>= gen_vocab_start_index``.
        mode: ``"none"`` (no generation token), ``"all"`` (only generation tokens) or ``"mixed"``.
        gen_index, und_index: flat token indices of each group (``"mixed"`` only).
    """

    gen_token_mask: torch.Tensor
    mode: str
    gen_index: torch.Tensor | None = None
    und_index: torch.Tensor | None = None

    @classmethod
    def from_mask(cls, gen_token_mask: torch.Tensor, n_gen: int) -> ExpertRouting:
        """Build from the mask and its (already host-side) count of True entries."""
        if n_gen == 0:
            return cls(gen_token_mask, "none")
        if n_gen == gen_token_mask.numel():
            return cls(gen_token_mask, "all")
        flat = gen_token_mask.reshape(-1)
        return cls(gen_token_mask, "mixed", flat.nonzero(as_tuple=True)[0], (~flat).nonzero(as_tuple=True)[0])


def route_experts(
    hidden_states: torch.Tensor,
    und_expert: Callable[[torch.Tensor], torch.Tensor],
    gen_expert: Callable[[torch.Tensor], torch.Tensor] | None,
    routing: ExpertRouting | None,
) -> torch.Tensor:
    """Hard routing between the understanding and the generation expert (upstream ``moe_forward``).

    Args:
        hidden_states: ``(batch, seq, in_features)``.
        und_expert: module for non-generation tokens.
        gen_expert: module for generation tokens; ``None`` (non-expert layer) routes all to
            ``und_expert``.
        routing: the forward's `ExpertRouting`; ``None`` routes all to ``und_expert``.

    Returns:
        ``(batch, seq, out_features)`` in token order. Each token's output depends only on that token
        and its expert, so the result equals upstream's permute/split/inverse-permute.
    """
    if gen_expert is None or routing is None or routing.mode == "none":
        return und_expert(hidden_states)
    if routing.mode == "all":
        return gen_expert(hidden_states)
    batch, seq, _ = hidden_states.shape
    flat = hidden_states.reshape(batch * seq, -1)
    gen_out = gen_expert(flat.index_select(0, routing.gen_index))
    und_out = und_expert(flat.index_select(0, routing.und_index))
    out = gen_out.new_empty(batch * seq, gen_out.shape[-1])
    out.index_copy_(0, routing.gen_index, gen_out)
    out.index_copy_(0, routing.und_index, und_out)
    return out.view(batch, seq, -1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dim: ``[x1, x2] -> [-x2, x1]`` (Qwen/Llama RoPE layout)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class MammothRotaryEmbedding(nn.Module):
    """1-D rotary embedding, ``inv_freq = theta^(-2i/head_dim)`` (transformers' "default" RoPE).

    ``inv_freq`` is a non-persistent buffer (not in the checkpoint), recomputed at construction.
    """

    def __init__(self, config: MammothARConfig) -> None:
        super().__init__()
        dim = config.head_dim
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float32) / dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)`` of shape ``(batch, seq, head_dim)`` in ``dtype``.

        Computed in float32 and then cast, as upstream does (so bf16 runs round the same way).
        """
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq.to(torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class KVCache:
    """Preallocated per-sequence key/value cache.

    Attributes:
        key, value: ``(num_layers, batch, num_kv_heads, capacity, head_dim)`` in the model dtype
            (keys are stored after RoPE).
        length: number of positions filled (the same for every batch row).
        capacity: maximum positions.

    The model writes a forward's new keys at ``[length, length + T)`` in every layer and advances
    `length` once that forward has finished.
    """

    def __init__(
        self,
        config: MammothARConfig,
        batch_size: int,
        capacity: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if batch_size < 1 or capacity < 1:
            raise ValueError(f"KVCache needs batch_size >= 1 and capacity >= 1, got {batch_size}, {capacity}")
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, capacity, config.head_dim)
        self.key = torch.zeros(shape, device=device, dtype=dtype)
        self.value = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0
        self.capacity = capacity
        self.batch_size = batch_size

    @classmethod
    def from_buffers(cls, key: torch.Tensor, value: torch.Tensor, length: int = 0) -> KVCache:
        """A cache over existing tensors (e.g. slots of `stage_ar.kv_pool.KVPool`), no allocation.

        Args:
            key, value: ``(num_layers, batch, num_kv_heads, capacity, head_dim)`` (views allowed;
                writes go through to them).
            length: positions already filled.

        Raises:
            ValueError: the two shapes differ, are not 5-D, or ``length`` is out of range.
        """
        if key.dim() != 5 or key.shape != value.shape:
            raise ValueError(f"key/value must be equal 5-D shapes, got {tuple(key.shape)}, {tuple(value.shape)}")
        if not 0 <= length <= key.shape[3]:
            raise ValueError(f"length {length} outside [0, {key.shape[3]}]")
        cache = cls.__new__(cls)
        cache.key, cache.value = key, value
        cache.length = int(length)
        cache.capacity = int(key.shape[3])
        cache.batch_size = int(key.shape[1])
        return cache

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value tensors."""
        return self.key.numel() * self.key.element_size() * 2

    @staticmethod
    def bytes_needed(config: MammothARConfig, batch_size: int, capacity: int, dtype: torch.dtype) -> int:
        """Bytes a cache of this size would take (for admission control before allocating):
        ``2 * layers * batch * kv_heads * capacity * head_dim * itemsize``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize
        return per_position * batch_size * capacity

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``/``value`` ``(batch, kv_heads, T, head_dim)`` after the filled part.

        Returns:
            keys and values of positions ``[0, length + T)`` of this layer.
        """
        end = self.length + key.shape[2]
        self.key[layer, :, :, self.length : end] = key
        self.value[layer, :, :, self.length : end] = value
        return self.key[layer, :, :, :end], self.value[layer, :, :, :end]


class MammothAttention(nn.Module):
    """Causal GQA self-attention with optional generation-expert projections.

    ``q/k/v_proj`` have biases, ``o_proj`` has none (Qwen2). In expert layers generation tokens use
    ``gen_{q,k,v,o}_proj`` instead; attention itself is computed jointly over all tokens.
    """

    def __init__(self, config: MammothARConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_out, bias=True)
        self.k_proj = nn.Linear(hidden, kv_out, bias=True)
        self.v_proj = nn.Linear(hidden, kv_out, bias=True)
        self.o_proj = nn.Linear(q_out, hidden, bias=False)
        self.has_experts = layer_idx in config.attention_expert_layers
        if self.has_experts:
            self.gen_q_proj = nn.Linear(hidden, q_out, bias=True)
            self.gen_k_proj = nn.Linear(hidden, kv_out, bias=True)
            self.gen_v_proj = nn.Linear(hidden, kv_out, bias=True)
            self.gen_o_proj = nn.Linear(q_out, hidden, bias=False)
        else:
            self.gen_q_proj = self.gen_k_proj = self.gen_v_proj = self.gen_o_proj = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor,
        routing: ExpertRouting | None,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        """``hidden_states (batch, T, hidden)`` -> ``(batch, T, hidden)``.

        ``attn_mask`` is a bool ``(batch, 1, T, S)`` (True = attend) over all ``S`` keys (cached + new).
        """
        batch, seq, _ = hidden_states.shape
        mask = routing if self.has_experts else None
        q = route_experts(hidden_states, self.q_proj, self.gen_q_proj, mask)
        k = route_experts(hidden_states, self.k_proj, self.gen_k_proj, mask)
        v = route_experts(hidden_states, self.v_proj, self.gen_v_proj, mask)
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        cos_b, sin_b = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos_b + rotate_half(q) * sin_b
        k = k * cos_b + rotate_half(k) * sin_b

        if kv_cache is not None:
            k, v = kv_cache.write(self.layer_idx, k, v)
        groups = self.num_heads // self.num_key_value_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.head_dim**-0.5)
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return route_experts(out, self.o_proj, self.gen_o_proj, mask)


class MammothDecoderLayer(nn.Module):
    """Pre-norm decoder block: ``h += attn(norm(h)); h += mlp(norm(h))`` with expert routing."""

    def __init__(self, config: MammothARConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MammothAttention(config, layer_idx)
        self.mlp = MammothMLP(config)
        self.gen_mlp = MammothMLP(config) if layer_idx in config.ffn_expert_layers else None
        self.input_layernorm = MammothRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MammothRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: torch.Tensor,
        routing: ExpertRouting | None,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), cos, sin, attn_mask, routing, kv_cache)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = route_experts(self.post_attention_layernorm(hidden_states), self.mlp, self.gen_mlp, routing)
        return residual + hidden_states


class MammothTextModel(nn.Module):
    """Embeddings, decoder layers and final norm (``model.language_model.*`` in the checkpoint)."""

    def __init__(self, config: MammothARConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.gen_embed_tokens = (
            nn.Embedding(config.gen_vocab_size, config.hidden_size) if config.extra_gen_vocab else None
        )
        self.layers = nn.ModuleList(MammothDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = MammothRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MammothRotaryEmbedding(config)

    def embed(self, input_ids: torch.Tensor, gen_token_mask: torch.Tensor) -> torch.Tensor:
        """Embedding scatter: ids ``>= gen_vocab_start_index`` read ``gen_embed_tokens(id - start)``.

        ``input_ids (batch, T)`` must lie in ``[0, full_vocab_size)`` (checked by `forward`).
        """
        cfg = self.config
        if self.gen_embed_tokens is None:
            return self.embed_tokens(input_ids)
        base_ids = input_ids.masked_fill(gen_token_mask, 0)
        gen_ids = (input_ids - cfg.gen_vocab_start_index).clamp_min(0).masked_fill(~gen_token_mask, 0)
        base = self.embed_tokens(base_ids)
        gen = self.gen_embed_tokens(gen_ids)
        return torch.where(gen_token_mask.unsqueeze(-1), gen, base)


class _MammothModelWrapper(nn.Module):
    """Holds ``language_model`` so parameter paths read ``model.language_model.*`` as upstream."""

    def __init__(self, config: MammothARConfig) -> None:
        super().__init__()
        self.language_model = MammothTextModel(config)


@dataclass
class ARForwardOutput:
    """Result of `MammothARForCausalLM.forward`.

    Attributes:
        last_hidden_state: ``(batch, T, hidden)`` after the final RMSNorm, model dtype.
        logits: ``(batch, T, vocab_size + gen_vocab_size)`` float32 (base head then gen head), or
            ``None`` when ``compute_logits=False``.
        all_hidden_states: with ``output_hidden_states=True``, ``num_layers + 1`` tensors
            ``(batch, T, hidden)``: the embeddings, the outputs of layers ``0..L-2`` and the final
            post-norm state (upstream's ``hidden_states`` convention); else ``None``.
    """

    last_hidden_state: torch.Tensor
    logits: torch.Tensor | None = None
    all_hidden_states: tuple[torch.Tensor, ...] | None = None


class MammothARForCausalLM(nn.Module):
    """MammothModa2 AR language model (upstream ``Mammothmoda2Qwen2_5_VLForConditionalGeneration``
    without the vision tower).

    State-dict keys equal the checkpoint's ``llm_model.*`` keys with the prefix removed, minus
    ``model.visual.*``: ``model.language_model.{embed_tokens, gen_embed_tokens, layers.N.*, norm}``,
    ``lm_head``, ``gen_head``.
    """

    _no_split_modules = ("MammothDecoderLayer",)
    _tied_weights_keys: tuple[str, ...] = ()

    def __init__(self, config: MammothARConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _MammothModelWrapper(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gen_head = (
            nn.Linear(config.hidden_size, config.gen_vocab_size, bias=False) if config.extra_gen_vocab else None
        )

    @classmethod
    def from_llm_config(cls, llm_config: dict[str, Any]) -> MammothARForCausalLM:
        """Construct (uninitialised weights) from the checkpoint's ``llm_config`` dict.

        Works under ``with torch.device("meta"):`` for shape checks without memory.
        """
        return cls(MammothARConfig.from_dict(llm_config))

    @property
    def language_model(self) -> MammothTextModel:
        return self.model.language_model

    def new_kv_cache(self, batch_size: int, capacity: int) -> KVCache:
        """A `KVCache` on this model's device and in its dtype."""
        param = self.lm_head.weight
        return KVCache(self.config, batch_size, capacity, device=param.device, dtype=param.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``cat([lm_head(h), gen_head(h)], -1)`` as float32; ``h`` is ``(..., hidden)``."""
        logits = self.lm_head(hidden_states)
        if self.gen_head is not None:
            logits = torch.cat([logits, self.gen_head(hidden_states)], dim=-1)
        return logits.float()

    @staticmethod
    def _build_mask(
        attention_mask: torch.Tensor | None,
        batch: int,
        seq: int,
        past: int,
        device: torch.device,
    ) -> torch.Tensor:
        """Bool ``(batch, 1, T, S)`` mask (True = attend), ``S = past + T``.

        ``attention_mask`` may be ``None`` (causal), a key mask ``(batch, S)`` (1/True = real token,
        combined with causality), or a ready ``(batch, 1, T, S)`` bool or additive float mask.
        Every query may always attend to its own position, so a fully padded query row yields
        finite values instead of NaN; such rows are padding and never read.
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
                    f"key attention_mask must be (batch, past+T) = {(batch, total)}, got {tuple(attention_mask.shape)}"
                )
            mask = causal & attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
        elif attention_mask.dim() == 4:
            if tuple(attention_mask.shape[-2:]) != (seq, total):
                raise ValueError(
                    f"4-D attention_mask must end in (T, S) = {(seq, total)}, got {tuple(attention_mask.shape)}"
                )
            full = attention_mask.to(device)
            mask = full if full.dtype == torch.bool else full > torch.finfo(full.dtype).min / 2
            mask = mask.expand(batch, 1, seq, total)
        else:
            raise ValueError(f"attention_mask must be 2-D or 4-D, got {attention_mask.dim()}-D")
        diagonal = (k_pos[None, :] == q_pos[:, None])[None, None]
        return mask | diagonal

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        kv_cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        compute_logits: bool = True,
    ) -> ARForwardOutput:
        """Run the decoder.

        Args:
            input_ids: ``(batch, T)`` int64; ids ``>= gen_vocab_start_index`` are generation tokens
                (generation embedding, experts in expert layers).
            position_ids: ``(batch, T)`` int64 RoPE positions (text-only M-RoPE = 1-D positions).
            kv_cache: optional `KVCache`; new keys/values are appended after ``kv_cache.length``
                and the length advances by ``T``. Without it the call is a full-sequence forward.
            attention_mask: ``None`` (causal), a key mask ``(batch, kv_len + T)`` (True/1 = attend,
                e.g. the AR-CFG unconditional row), or a bool/additive ``(batch, 1, T, kv_len + T)``.
            output_hidden_states: also return every layer's input and the final state.
            compute_logits: compute float32 logits for every row (set False and call
                `compute_logits` on selected rows to save work).

        Returns:
            `ARForwardOutput`.

        Raises:
            ValueError: bad shapes, ids out of range, or a cache without room for ``T`` positions.
        """
        if input_ids.dim() != 2 or tuple(position_ids.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"input_ids and position_ids must both be (batch, T); got {tuple(input_ids.shape)}, "
                f"{tuple(position_ids.shape)}"
            )
        batch, seq = input_ids.shape
        past = 0
        if kv_cache is not None:
            if kv_cache.batch_size != batch:
                raise ValueError(f"kv_cache batch {kv_cache.batch_size} != input batch {batch}")
            if kv_cache.length + seq > kv_cache.capacity:
                raise ValueError(f"kv_cache full: {kv_cache.length} + {seq} positions > capacity {kv_cache.capacity}")
            past = kv_cache.length
        lm = self.model.language_model
        if input_ids.numel() == 0:
            raise ValueError("input_ids is empty")
        gen_token_mask = input_ids >= self.config.gen_vocab_start_index
        # One host sync per forward: id range check and the generation-token count together.
        id_min, id_max, n_gen = torch.stack([input_ids.min(), input_ids.max(), gen_token_mask.sum()]).tolist()
        if id_min < 0 or id_max >= self.config.full_vocab_size:
            raise ValueError(f"token id out of range [0, {self.config.full_vocab_size}): min {id_min}, max {id_max}")
        routing = ExpertRouting.from_mask(gen_token_mask, n_gen)
        hidden_states = lm.embed(input_ids, gen_token_mask)
        attn_mask = self._build_mask(attention_mask, batch, seq, past, hidden_states.device)
        cos, sin = lm.rotary_emb(position_ids, hidden_states.dtype)

        all_hidden: list[torch.Tensor] | None = [] if output_hidden_states else None
        for layer in lm.layers:
            if all_hidden is not None:
                all_hidden.append(hidden_states)
            hidden_states = layer(hidden_states, cos, sin, attn_mask, routing, kv_cache)
        hidden_states = lm.norm(hidden_states)
        if all_hidden is not None:
            all_hidden.append(hidden_states)
        if kv_cache is not None:
            kv_cache.length += seq
        return ARForwardOutput(
            last_hidden_state=hidden_states,
            logits=self.compute_logits(hidden_states) if compute_logits else None,
            all_hidden_states=tuple(all_hidden) if all_hidden is not None else None,
        )
