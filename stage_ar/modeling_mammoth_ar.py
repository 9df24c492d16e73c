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

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stage_ar.attention import AttentionBackend, SDPAAttention, build_attention_mask
from stage_ar.configuration_mammoth_ar import MammothARConfig
from stage_ar.expert_routing import ExpertRouting, route_experts, single_expert
from stage_ar.fp8_activations import RowsWithAmax
from stage_ar.kv_pool import KVCache
from stage_ar.layers import EAGER_OPS, PointwiseOps, RMSNorm, rotate_half  # noqa: F401 - rotate_half re-exported
from stage_ar.linear import TORCH_LINEAR, MammothLinear, PreNorm, norm_input

__all__ = [
    "ARForwardOutput",
    "ExpertRouting",
    "ForwardContext",
    "STACKED_PARAMS",
    "MammothARForCausalLM",
    "build_key_mask",
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


def build_key_mask(key_starts: list[int], length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bool key mask ``(len(key_starts), length)``: row ``r`` attends to positions ``>= key_starts[r]``
    (the AR-CFG unconditional row keeps only its last prompt tokens)."""
    starts = torch.tensor(key_starts, dtype=torch.long, device=device)
    return torch.arange(length, device=device)[None, :] >= starts[:, None]


#: Fused parameters and the checkpoint tensors stacked into them, in order:
#: ``fused name -> (checkpoint names)``, siblings inside one module.
STACKED_PARAMS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gen_qkv_proj": ("gen_q_proj", "gen_k_proj", "gen_v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def _stack_hooks(module: nn.Module, fused: str, parts: tuple[str, ...], sizes: tuple[int, ...]) -> None:
    """Make ``module``'s state dict speak checkpoint names: ``fused.{weight,bias,weight_scale}`` (the
    scale: FP8 weights, `stage_ar.linear.MammothLinear`) appears as the ``parts`` (views into the fused
    tensors: no copy), and loading those names fills the fused one."""
    suffixes = ("weight", "bias", "weight_scale")

    def save(mod, state_dict, prefix, local_metadata) -> None:
        for suffix in suffixes:
            tensor = state_dict.pop(f"{prefix}{fused}.{suffix}", None)
            if tensor is None:
                continue
            for name, piece in zip(parts, tensor.detach().split(sizes, dim=0)):
                state_dict[f"{prefix}{name}.{suffix}"] = piece

    def load(mod, state_dict, prefix, *args) -> None:
        for suffix in suffixes:
            keys = [f"{prefix}{name}.{suffix}" for name in parts]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}{fused}.{suffix}"] = torch.cat([state_dict.pop(k) for k in keys])

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)


class MammothMLP(nn.Module):
    """SwiGLU feed-forward ``down_proj(silu(gate) * up)`` with ``gate_proj``/``up_proj`` stacked in
    one ``gate_up_proj`` (state dict under the checkpoint names), no biases."""

    def __init__(self, config: MammothARConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MammothLinear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = MammothLinear(inter, config.hidden_size, bias=False)
        _stack_hooks(self, "gate_up_proj", STACKED_PARAMS["gate_up_proj"], (inter, inter))

    def forward(self, x: Any, ops: PointwiseOps = EAGER_OPS, then: PreNorm | None = None) -> Any:
        """``x (..., hidden)`` (under W8A8 possibly `QuantizedRows` or `DelayedRows`) -> ``(..., hidden)``;
        SwiGLU by ``ops`` (or in the GEMV's epilogue, `stage_ar.linear.GemvLinear`'s ``fuse_epilogues``),
        the two projections through their backend's `stage_ar.linear.LinearBackend.mlp`. ``then``: the
        pre-norm after the MLP (`stage_ar.linear.PreNorm`): returns `stage_ar.linear.norm_input`'s pair
        for it instead (`stage_ar.linear.LinearBackend.project_norm_input`)."""
        return self.gate_up_proj.backend.mlp(x, self.gate_up_proj, self.down_proj, ops.silu_and_mul, then)


class MammothRotaryEmbedding(nn.Module):
    """1-D rotary embedding, ``inv_freq = theta^(-2i/head_dim)`` (transformers' "default" RoPE).

    ``inv_freq`` is a non-persistent buffer (not in the checkpoint), recomputed at construction.
    """

    def __init__(self, config: MammothARConfig) -> None:
        super().__init__()
        dim = config.head_dim
        # On the default device; under ``meta`` (shape checks: `mammoth_core.meta_build`) computed on
        # the CPU and moved there, since arithmetic on meta tensors imports torch._dynamo (seconds).
        target = torch.empty(0).device
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu" if target.type == "meta" else target)
        inv_freq = 1.0 / (config.rope_theta ** (exponents.to(dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq.to(target), persistent=False)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)`` of shape ``(batch, seq, head_dim)`` in ``dtype``.

        Computed in float32 and then cast, as upstream does (so bf16 runs round the same way).
        """
        freqs = position_ids.to(torch.float32)[..., None] * self.inv_freq.to(torch.float32)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


@dataclass
class ForwardContext:
    """What every layer of one forward shares: RoPE tables ``(B, T, d)``, expert routing, the
    attention backend and the pointwise kernels."""

    cos: torch.Tensor
    sin: torch.Tensor
    routing: ExpertRouting | None
    attention: AttentionBackend
    ops: PointwiseOps = EAGER_OPS


def rows_are_slots(ctx: ForwardContext) -> bool:
    """Whether the forward is a decode step whose rows are the pool's slots (the attention backend says
    so: `stage_ar.attention.TritonDecodeAttention`), the only forward where per-row state kept across
    steps (delayed activation scales) may be read and advanced."""
    return bool(getattr(ctx.attention, "rows_are_slots", False))


class MammothAttention(nn.Module):
    """Causal GQA self-attention with optional generation-expert projections.

    ``q/k/v_proj`` (biases) are stacked in ``qkv_proj`` (``gen_q/k/v_proj`` in ``gen_qkv_proj``) and
    saved/loaded under the checkpoint names; ``o_proj`` has no bias (Qwen2). In expert layers
    generation tokens use the ``gen_*`` projections; attention is computed jointly over all tokens
    by the forward's attention backend.
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
        sizes = (q_out, kv_out, kv_out)
        self.qkv_proj = MammothLinear(hidden, sum(sizes), bias=True)
        self.o_proj = MammothLinear(q_out, hidden, bias=False)
        _stack_hooks(self, "qkv_proj", STACKED_PARAMS["qkv_proj"], sizes)
        self.has_experts = layer_idx in config.attention_expert_layers
        self.gen_qkv_proj = MammothLinear(hidden, sum(sizes), bias=True) if self.has_experts else None
        self.gen_o_proj = MammothLinear(q_out, hidden, bias=False) if self.has_experts else None
        if self.has_experts:
            _stack_hooks(self, "gen_qkv_proj", STACKED_PARAMS["gen_qkv_proj"], sizes)

    def input_projection(self, routing: ExpertRouting | None) -> MammothLinear | None:
        """The qkv projection every token of a forward with ``routing`` goes through, or None when
        the tokens are split between the two experts."""
        return single_expert(self.qkv_proj, self.gen_qkv_proj, routing if self.has_experts else None)

    def forward(self, hidden_states: Any, ctx: ForwardContext, then: PreNorm) -> tuple[Any, torch.Tensor]:
        """``hidden_states (B, T, hidden)`` (or, under W8A8, those rows quantized for `input_projection`:
        `stage_ar.linear.norm_input`, `QuantizedRows` or `DelayedRows`) and ``then``, the pre-norm after
        the attention -> `stage_ar.linear.norm_input`'s pair for the ``(B, T, hidden)`` attention output:
        o_proj and the norm through `stage_ar.linear.LinearBackend.project_norm_input` where one
        projection takes every token."""
        routing = ctx.routing if self.has_experts else None
        heads, kv_heads = self.num_heads, self.num_key_value_heads
        qkv_proj = self.input_projection(ctx.routing)
        if qkv_proj is not None:  # one projection for every token: RoPE may run in its epilogue
            q, k, v = qkv_proj.forward_rope_qkv(hidden_states, ctx.cos, ctx.sin, heads, kv_heads, ctx.ops.rope_qkv,
                                                rows_are_slots(ctx))
        else:
            qkv = route_experts(hidden_states, self.qkv_proj, self.gen_qkv_proj, routing)
            q, k, v = ctx.ops.rope_qkv(qkv, ctx.cos, ctx.sin, heads, kv_heads)
        o_proj = single_expert(self.o_proj, self.gen_o_proj, routing)
        if o_proj is None:
            return then.apply(route_experts(ctx.attention.forward(self.layer_idx, q, k, v), self.o_proj,
                                            self.gen_o_proj, routing))
        buffers = None
        if getattr(ctx.attention, "gathers_amax", False):  # W8A8: o_proj's input from the combine
            delayed = o_proj.backend.delayed_input(o_proj, q.shape[0] * q.shape[1], then.layer)
            if delayed is not None:  # delayed scales: the combine writes o_proj's codes
                _, codes = ctx.attention.forward(self.layer_idx, q, k, v, delayed_out=delayed)
                return o_proj.backend.project_norm_input(o_proj, codes, then)
            buffers = o_proj.backend.input_amax(o_proj, q.shape[0] * q.shape[1])
        if buffers is None:
            return o_proj.backend.project_norm_input(o_proj, ctx.attention.forward(self.layer_idx, q, k, v), then)
        out = ctx.attention.forward(self.layer_idx, q, k, v, amax_out=buffers[0])
        return o_proj.backend.project_norm_input(o_proj, RowsWithAmax(out, *buffers), then)


class MammothDecoderLayer(nn.Module):
    """Pre-norm decoder block with expert routing, residual stream carried separately:
    ``h, r = norm(h, r); h = attn(h); h, r = norm(h, r); h = mlp(h)`` (the residual add fused into
    each norm; the first layer starts with ``r = None``). Each norm runs through the backend of the
    projection that reads it (`stage_ar.linear.norm_input`: under W8A8 the GEMV gets its rows
    quantized by the same launch)."""

    def __init__(self, config: MammothARConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MammothAttention(config, layer_idx)
        self.mlp = MammothMLP(config)
        self.gen_mlp = MammothMLP(config) if layer_idx in config.ffn_expert_layers else None
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, hidden_states: Any, residual: torch.Tensor | None, ctx: ForwardContext,
        following: MammothDecoderLayer | None = None, normalised: bool = False,
    ) -> tuple[Any, torch.Tensor]:
        """``(B, T, hidden)`` states and residual stream -> this layer's ``(mlp output, residual)``;
        the layer's output is their sum (formed by the next norm). ``following``: the next layer, whose
        input norm is then this layer's last step (``(norm_input's rows, the sum)``: under W8A8 possibly
        `QuantizedRows` or `DelayedRows`), so that down_proj and it may be one launch
        (`stage_ar.linear.LinearBackend.project_norm_input`); o_proj and the post-attention norm go
        through it likewise. ``normalised``: ``hidden_states`` are such rows from the layer before, so
        this layer's input norm is skipped."""
        qkv_proj = self.self_attn.input_projection(ctx.routing)
        state = qkv_proj if rows_are_slots(ctx) else None  # delayed activation scales live per slot
        if not normalised:
            hidden_states, residual = norm_input(self.input_layernorm, hidden_states, residual, ctx.ops, qkv_proj)
        routing = ctx.routing if self.gen_mlp is not None else None
        mlp = single_expert(self.mlp, self.gen_mlp, routing)
        hidden_states, residual = self.self_attn(hidden_states, ctx, PreNorm(
            self.post_attention_layernorm, residual, ctx.ops, mlp.gate_up_proj if mlp is not None else None,
            state, "attention"))
        if following is None:
            return route_experts(hidden_states, self.mlp, self.gen_mlp, routing, ctx.ops), residual
        then = PreNorm(following.input_layernorm, residual, ctx.ops,
                       following.self_attn.input_projection(ctx.routing), state, "mlp")
        if mlp is not None:
            return mlp(hidden_states, ctx.ops, then)
        return then.apply(route_experts(hidden_states, self.mlp, self.gen_mlp, routing, ctx.ops))


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
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MammothRotaryEmbedding(config)

    def embed(self, input_ids: torch.Tensor, routing: ExpertRouting) -> torch.Tensor:
        """Embedding scatter: ids ``>= gen_vocab_start_index`` read ``gen_embed_tokens(id - start)``.

        ``input_ids (batch, T)`` must lie in ``[0, full_vocab_size)`` (checked by `forward`).
        """
        cfg = self.config
        if self.gen_embed_tokens is None or routing.mode == "none":
            return self.embed_tokens(input_ids)
        if routing.mode == "all":
            return self.gen_embed_tokens(input_ids - cfg.gen_vocab_start_index)
        gen_token_mask = routing.gen_token_mask
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
    #: how every `MammothLinear` multiplies (`stage_ar.linear.set_linear_backend` changes it)
    linear_backend = TORCH_LINEAR

    def __init__(self, config: MammothARConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _MammothModelWrapper(config)
        self.lm_head = MammothLinear(config.hidden_size, config.vocab_size, bias=False)
        self.gen_head = (
            MammothLinear(config.hidden_size, config.gen_vocab_size, bias=False) if config.extra_gen_vocab else None
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

    def visual_token_linears(self) -> list[MammothLinear]:
        """The projections and MLP weights a generation (visual) token reads, layer by layer: the
        ``gen_*`` experts where a layer has them, the shared ones elsewhere (FP8 converts these)."""
        out: list[MammothLinear] = []
        for layer in self.language_model.layers:
            attn = layer.self_attn
            out += [attn.gen_qkv_proj, attn.gen_o_proj] if attn.has_experts else [attn.qkv_proj, attn.o_proj]
            mlp = layer.gen_mlp if layer.gen_mlp is not None else layer.mlp
            out += [mlp.gate_up_proj, mlp.down_proj]
        return out

    def new_kv_cache(self, batch_size: int, capacity: int) -> KVCache:
        """A `KVCache` on this model's device and in its dtype."""
        param = self.lm_head.weight
        return KVCache(self.config, batch_size, capacity, device=param.device, dtype=param.dtype)

    def compute_logits(self, hidden_states: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Float32 logits of vocabulary ids ``[start, end)`` (default: all, base head then gen head)
        for ``hidden_states (..., hidden)``; a range inside one head multiplies only those rows."""
        base = self.config.vocab_size
        end = self.config.full_vocab_size if end is None else end
        if self.gen_head is None or end <= base:
            return self.lm_head.forward_rows(hidden_states, start, end).float()
        if start >= base:
            return self.gen_head.forward_rows(hidden_states, start - base, end - base).float()
        logits = torch.cat([self.lm_head(hidden_states), self.gen_head(hidden_states)], dim=-1)
        return logits[..., start:end].float()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        kv_cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        compute_logits: bool = True,
        *,
        attention: AttentionBackend | None = None,
        routing: ExpertRouting | None = None,
        ops: PointwiseOps = EAGER_OPS,
    ) -> ARForwardOutput:
        """Run the decoder (the one forward: prefill, the B=1 reference and the batched decode step).

        Args:
            input_ids: ``(batch, T)`` int64; ids ``>= gen_vocab_start_index`` are generation tokens
                (generation embedding, experts in expert layers).
            position_ids: ``(batch, T)`` int64 RoPE positions (text-only M-RoPE = 1-D positions).
            kv_cache: optional `KVCache` for the default SDPA backend; new keys/values are appended
                after ``kv_cache.length`` and the length advances by ``T``. Without it (and without
                ``attention``) the call is a full-sequence forward.
            attention_mask: SDPA backend only: ``None`` (causal), a key mask ``(batch, kv_len + T)``
                (True/1 = attend, e.g. the AR-CFG unconditional row), or a bool/additive
                ``(batch, 1, T, kv_len + T)``.
            output_hidden_states: also return every layer's input and the final state.
            compute_logits: compute float32 logits for every row (set False and call
                `compute_logits` on selected rows to save work).
            attention: an `stage_ar.attention` backend that owns the keys/values (the batched
                decode step); replaces ``kv_cache``/``attention_mask``.
            routing: the tokens' expert routing when the caller knows it (e.g.
                `ExpertRouting.all_generation`); skips the id check and its host sync, so the call
                can be captured in a CUDA graph.
            ops: pointwise kernels (`stage_ar.layers.compiled_ops` on the CUDA decode step).

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
        if input_ids.numel() == 0:
            raise ValueError("input_ids is empty")
        batch, seq = input_ids.shape
        lm = self.model.language_model
        if routing is None:
            routing = self._routing(input_ids)
        hidden_states = lm.embed(input_ids, routing)
        if attention is None:
            attention = self._sdpa(kv_cache, attention_mask, batch, seq, hidden_states.device)
        cos, sin = lm.rotary_emb(position_ids, hidden_states.dtype)
        ctx = ForwardContext(cos, sin, routing, attention, ops)

        all_hidden: list[torch.Tensor] | None = [] if output_hidden_states else None
        residual: torch.Tensor | None = None
        layers = lm.layers
        normalised = False  # each layer but the last runs the next one's input norm (its down_proj may fold it)
        for i, layer in enumerate(layers):
            if all_hidden is not None:  # the layer's input (once normalised, the sum is the residual)
                all_hidden.append(hidden_states if residual is None else residual if normalised
                                  else residual + hidden_states)
            following = layers[i + 1] if i + 1 < len(layers) else None
            hidden_states, residual = layer(hidden_states, residual, ctx, following, normalised)
            normalised = following is not None
        hidden_states, _ = lm.norm(hidden_states, residual, kernels=ops)
        if all_hidden is not None:
            all_hidden.append(hidden_states)
        if kv_cache is not None:
            kv_cache.length += seq
        return ARForwardOutput(
            last_hidden_state=hidden_states,
            logits=self.compute_logits(hidden_states) if compute_logits else None,
            all_hidden_states=tuple(all_hidden) if all_hidden is not None else None,
        )

    def _routing(self, input_ids: torch.Tensor) -> ExpertRouting:
        """Routing from the ids, with their range check (one host sync for both)."""
        gen_token_mask = input_ids >= self.config.gen_vocab_start_index
        id_min, id_max, n_gen = torch.stack([input_ids.min(), input_ids.max(), gen_token_mask.sum()]).tolist()
        if id_min < 0 or id_max >= self.config.full_vocab_size:
            raise ValueError(f"token id out of range [0, {self.config.full_vocab_size}): min {id_min}, max {id_max}")
        return ExpertRouting.from_mask(gen_token_mask, n_gen)

    def _sdpa(self, kv_cache: KVCache | None, attention_mask: torch.Tensor | None, batch: int, seq: int,
              device: torch.device) -> SDPAAttention:
        past = 0
        if kv_cache is not None:
            if kv_cache.batch_size != batch:
                raise ValueError(f"kv_cache batch {kv_cache.batch_size} != input batch {batch}")
            if kv_cache.length + seq > kv_cache.capacity:
                raise ValueError(f"kv_cache full: {kv_cache.length} + {seq} positions > capacity {kv_cache.capacity}")
            past = kv_cache.length
        mask = build_attention_mask(attention_mask, batch, seq, past, device)
        return SDPAAttention(kv_cache, mask, self.config.head_dim**-0.5)
