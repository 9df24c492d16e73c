"""MammothModa2 diffusion transformer (`gen_transformer.*`).

A Lumina2/OmniGen2-style single-stream DiT as in upstream `bytedance/mammothmoda` (commit
2317bbce, `mammothmoda2/model/mammothmoda2_dit/diffusion_transformer.py`): conditions and image
patches are refined separately, then attended jointly. Attribute paths equal the checkpoint keys
below `gen_transformer.`; a strict `load_state_dict` of that slice reports nothing missing or
unexpected.

Differences from upstream (see docs/MODEL_DIFFERENCES.md): the key padding mask is applied on every
device (upstream's CPU path ignores it), conditions of different lengths can be batched, and
reference-image conditioning (`ref_image_*`, `image_index_embedding`) is kept for the weights but
not run (text-to-image only; upstream runs it on an empty sequence, which is a no-op).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from mammoth_core import limits
from stage_dit import fused
from stage_dit.modules import (
    LayerNormContinuous,
    RMSNorm,
    RMSNormZero,
    pad_rows,
    right_padded_lengths,
    round_up,
    SwiGLUFeedForward,
    apply_rotary_emb_complex,
    masked_attention,
    rotary_axis_table,
)


class MammothAttention(nn.Module):
    """Self-attention with grouped KV heads, per-head QK RMSNorm and 3-axis real RoPE.

    Keys: `to_q`, `to_k`, `to_v`, `to_out.0` (no biases), `norm_q`, `norm_k` (RMSNorm over head_dim,
    eps 1e-5 as upstream's diffusers `Attention(qk_norm="rms_norm", eps=1e-5)`).
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, qk_norm_eps: float = 1e-5) -> None:
        super().__init__()
        if dim % num_heads or num_heads % num_kv_heads:
            raise ValueError(f"dim {dim}, heads {num_heads} and kv heads {num_kv_heads} do not divide")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = dim // num_heads
        self.to_q = nn.Linear(dim, num_heads * self.head_dim, bias=False)
        self.to_k = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.to_v = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(num_heads * self.head_dim, dim, bias=False), nn.Identity()])
        self.norm_q = RMSNorm(self.head_dim, eps=qk_norm_eps)
        self.norm_k = RMSNorm(self.head_dim, eps=qk_norm_eps)
        #: ``(query, key, value, key_mask, key_lengths) -> (B, S, heads * head_dim)``; the
        #: sequence-parallel mode (`stage_dit.parallel`) swaps in its all-to-all attention.
        self.attention_backend = masked_attention

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rotary_emb: torch.Tensor,
        key_lengths: list[int] | None = None,
    ) -> torch.Tensor:
        """Attend over one sequence.

        Args:
            hidden_states: `(batch, seq, dim)`.
            attention_mask: bool `(batch, seq)`, True = real token; None = no padding.
            rotary_emb: complex64 `(batch, seq, head_dim / 2)` (`modules.rotary_complex`).
            key_lengths: host ints, real rows per element when the padding is on the right (the fast
                path of `masked_attention`); None = use `attention_mask`.

        Returns:
            `(batch, seq, dim)`.
        """
        b, s, _ = hidden_states.shape
        dtype = hidden_states.dtype
        query = self.to_q(hidden_states).view(b, s, self.num_heads, self.head_dim)
        key = self.to_k(hidden_states).view(b, s, self.num_kv_heads, self.head_dim)
        value = self.to_v(hidden_states).view(b, s, self.num_kv_heads, self.head_dim)
        if fused.enabled(hidden_states):  # QK-norm and RoPE in one kernel each (`stage_dit.fused`)
            query = fused.qk_norm_rope(query, self.norm_q.weight, self.norm_q.variance_epsilon, rotary_emb)
            key = fused.qk_norm_rope(key, self.norm_k.weight, self.norm_k.variance_epsilon, rotary_emb)
        else:
            query = apply_rotary_emb_complex(self.norm_q(query), rotary_emb).to(dtype)
            key = apply_rotary_emb_complex(self.norm_k(key), rotary_emb).to(dtype)
        out = self.attention_backend(query, key, value, attention_mask, key_lengths).to(dtype)
        return self.to_out[0](out)


class MammothTransformerBlock(nn.Module):
    """Sandwich-norm transformer block, optionally adaLN-modulated with tanh gates.

    Modulated: `h += tanh(g_msa) * norm2(attn(norm1(h) * (1 + s_msa)))`, then
    `h += tanh(g_mlp) * ffn_norm2(ffn(ffn_norm1(h) * (1 + s_mlp)))`. Unmodulated (context refiner):
    the same without scales and gates, `norm1` a plain RMSNorm.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        multiple_of: int,
        ffn_dim_multiplier: float | None,
        norm_eps: float,
        modulation: bool = True,
    ) -> None:
        super().__init__()
        self.modulation = modulation
        self.attn = MammothAttention(dim, num_heads, num_kv_heads)
        self.feed_forward = SwiGLUFeedForward(dim, 4 * dim, multiple_of, ffn_dim_multiplier)
        self.norm1 = RMSNormZero(dim, min(dim, 1024), norm_eps) if modulation else RMSNorm(dim, eps=norm_eps)
        self.ffn_norm1 = RMSNorm(dim, eps=norm_eps)
        self.norm2 = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm2 = RMSNorm(dim, eps=norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        rotary_emb: torch.Tensor,
        temb: torch.Tensor | None = None,
        key_lengths: list[int] | None = None,
    ) -> torch.Tensor:
        """hidden_states `(batch, seq, dim)`, mask bool `(batch, seq)` or None, rotary complex64
        `(batch, seq, head_dim / 2)`, temb `(batch, temb_dim)`, key_lengths host ints (right padding).

        On CUDA in 16-bit the same arithmetic runs as fused kernels (`_forward_fused`)."""
        if fused.enabled(hidden_states):
            return self._forward_fused(hidden_states, attention_mask, rotary_emb, temb, key_lengths)
        if self.modulation:
            if temb is None:
                raise ValueError("a modulated block needs temb")
            normed, gate_msa, scale_mlp, gate_mlp = self.norm1(hidden_states, temb)
            attn_out = self.attn(normed, attention_mask, rotary_emb, key_lengths)
            hidden_states = hidden_states + gate_msa[:, None].tanh() * self.norm2(attn_out)
            ffn_out = self.feed_forward(self.ffn_norm1(hidden_states) * (1 + scale_mlp[:, None]))
            return hidden_states + gate_mlp[:, None].tanh() * self.ffn_norm2(ffn_out)
        attn_out = self.attn(self.norm1(hidden_states), attention_mask, rotary_emb, key_lengths)
        hidden_states = hidden_states + self.norm2(attn_out)
        return hidden_states + self.ffn_norm2(self.feed_forward(self.ffn_norm1(hidden_states)))

    def _forward_fused(self, hidden_states, attention_mask, rotary_emb, temb, key_lengths) -> torch.Tensor:
        """`forward` with each norm/modulation/gate/residual chain as one `stage_dit.fused` kernel
        (an unmodulated block is the same with no scales and gates)."""
        h = hidden_states.contiguous()
        if self.modulation:
            if temb is None:
                raise ValueError("a modulated block needs temb")
            scale_msa, gate_msa, scale_mlp, gate_mlp = self.norm1.modulations(temb, h.shape[0])
            norm1 = self.norm1.norm
        else:
            scale_msa = gate_msa = scale_mlp = gate_mlp = None
            norm1 = self.norm1
        normed = fused.rms_norm_modulate(h, norm1.weight, norm1.variance_epsilon, scale_msa)
        attn_out = self.attn(normed, attention_mask, rotary_emb, key_lengths)
        h = fused.gated_residual(h, attn_out, self.norm2.weight, self.norm2.variance_epsilon, gate_msa)
        ffn_in = fused.rms_norm_modulate(h, self.ffn_norm1.weight, self.ffn_norm1.variance_epsilon, scale_mlp)
        ffn_out = self.feed_forward(ffn_in)
        return fused.gated_residual(h, ffn_out, self.ffn_norm2.weight, self.ffn_norm2.variance_epsilon, gate_mlp)


class CombinedTimestepCaptionEmbedding(nn.Module):
    """Time and caption embedding (keys `timestep_embedder.linear_{1,2}`, `caption_embedder.{0,1}`).

    `temb = linear_2(silu(linear_1(sinusoid_256(t))))` with diffusers' `Timesteps(256,
    flip_sin_to_cos=True, downscale_freq_shift=0, scale=timestep_scale)`; width `min(hidden, 1024)`.
    `caption = Linear(RMSNorm(cond))` over the LLM width, as upstream's `reinit_caption_embedder`
    rebuilds it (`Qwen2RMSNorm(llm_hidden, eps=1e-5)`, `Linear(llm_hidden, hidden)`).
    """

    def __init__(
        self,
        hidden_size: int,
        text_feat_dim: int,
        frequency_embedding_size: int = 256,
        timestep_scale: float = 1.0,
        caption_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.time_proj = Timesteps(
            num_channels=frequency_embedding_size,
            flip_sin_to_cos=True,
            downscale_freq_shift=0.0,
            scale=timestep_scale,
        )
        self.timestep_embedder = TimestepEmbedding(frequency_embedding_size, min(hidden_size, 1024))
        self.caption_embedder = nn.Sequential(
            RMSNorm(text_feat_dim, eps=caption_norm_eps), nn.Linear(text_feat_dim, hidden_size, bias=True)
        )

    def forward(self, timestep: torch.Tensor, text_hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """timestep float `(batch,)` in [0, 1]; text `(batch, seq, text_feat_dim)` ->
        (temb `(batch, min(hidden, 1024))`, caption `(batch, seq, hidden)`)."""
        return self.time(timestep), self.caption(text_hidden_states)

    def time(self, timestep: torch.Tensor) -> torch.Tensor:
        """temb `(batch, min(hidden, 1024))` of float `timestep` `(batch,)` (`forward`'s first output)."""
        return self.timestep_embedder(self.time_proj(timestep).to(self.caption_embedder[1].weight.dtype))

    def caption(self, text_hidden_states: torch.Tensor) -> torch.Tensor:
        """caption `(batch, seq, hidden)` of `(batch, seq, text_feat_dim)` (`forward`'s second output)."""
        return self.caption_embedder(text_hidden_states)


class MammothTransformer2DModel(ModelMixin, ConfigMixin):
    """The MammothModa2 DiT: predicts the flow-matching velocity of a latent image.

    `__init__` keywords are the keys of the checkpoint's `gen_dit_config` plus `llm_hidden_size` (the
    width of the AR hidden states the caption embedder reads, upstream's `reinit_caption_embedder`).
    Defaults mirror upstream's `Transformer2DModel`.

    Args:
        patch_size: side of a latent patch (2).
        in_channels: latent channels (16).
        out_channels: predicted channels; None = `in_channels`.
        hidden_size: transformer width.
        num_layers: joint blocks (`layers`).
        num_refiner_layers: blocks in each of `noise_refiner`, `ref_image_refiner`, `context_refiner`.
        num_attention_heads, num_kv_heads: query heads and grouped KV heads.
        multiple_of, ffn_dim_multiplier: SwiGLU width rule (`modules.swiglu_inner_dim` of `4*hidden`).
        norm_eps: eps of the block RMSNorms.
        axes_dim_rope: rotary dims per axis (sum = head dim).
        axes_lens: rotary table length per axis (the largest position + 1 an axis may take).
        text_feat_dim: upstream's original caption width; unused (replaced by `llm_hidden_size`).
        timestep_scale: multiplies t before the sinusoid (1000 in the checkpoints).
        llm_hidden_size: AR hidden width; None = `text_feat_dim`.
        rope_theta: rotary base (upstream hard-codes 10000).

    Raises:
        ValueError: if `hidden_size // num_attention_heads != sum(axes_dim_rope)` or heads do not divide.
    """

    _no_split_modules = ["MammothTransformerBlock"]

    @register_to_config
    def __init__(
        self,
        patch_size: int = 2,
        in_channels: int = 16,
        out_channels: int | None = None,
        hidden_size: int = 2304,
        num_layers: int = 26,
        num_refiner_layers: int = 2,
        num_attention_heads: int = 24,
        num_kv_heads: int = 8,
        multiple_of: int = 256,
        ffn_dim_multiplier: float | None = None,
        norm_eps: float = 1e-5,
        axes_dim_rope: tuple[int, ...] = (32, 32, 32),
        axes_lens: tuple[int, ...] = (300, 512, 512),
        text_feat_dim: int = 1024,
        timestep_scale: float = 1.0,
        llm_hidden_size: int | None = None,
        rope_theta: float = 10000.0,
    ) -> None:
        super().__init__()
        if hidden_size // num_attention_heads != sum(axes_dim_rope):
            raise ValueError(
                f"hidden_size // num_attention_heads ({hidden_size // num_attention_heads}) "
                f"must equal sum(axes_dim_rope) ({sum(axes_dim_rope)})"
            )
        if len(axes_dim_rope) != 3 or len(axes_lens) != 3:
            raise ValueError("axes_dim_rope and axes_lens need three entries (caption/frame, row, column)")
        self.out_channels = out_channels or in_channels
        temb_dim = min(hidden_size, 1024)
        patch_dim = patch_size * patch_size * in_channels

        def blocks(count: int, modulation: bool = True) -> nn.ModuleList:
            return nn.ModuleList(
                MammothTransformerBlock(hidden_size, num_attention_heads, num_kv_heads, multiple_of,
                                        ffn_dim_multiplier, norm_eps, modulation=modulation)
                for _ in range(count)
            )

        self.x_embedder = nn.Linear(patch_dim, hidden_size)
        self.ref_image_patch_embedder = nn.Linear(patch_dim, hidden_size)
        self.time_caption_embed = CombinedTimestepCaptionEmbedding(
            hidden_size, llm_hidden_size or text_feat_dim, timestep_scale=timestep_scale
        )
        self.noise_refiner = blocks(num_refiner_layers)
        self.ref_image_refiner = blocks(num_refiner_layers)
        self.context_refiner = blocks(num_refiner_layers, modulation=False)
        self.layers = blocks(num_layers)
        self.norm_out = LayerNormContinuous(hidden_size, temb_dim, patch_size * patch_size * self.out_channels)
        self.image_index_embedding = nn.Parameter(torch.zeros(5, hidden_size))
        self._rope_cache: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    # -- rotary positions -------------------------------------------------------------------------

    def _rope_tables(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-axis float32 half tables `(cos, sin)`, each `(axes_lens[i], axes_dim_rope[i] / 2)` (one
        entry per rotated pair), built once per device."""
        if device not in self._rope_cache:
            self._rope_cache[device] = [
                (cos[:, 0::2].contiguous().to(device), sin[:, 0::2].contiguous().to(device))
                for cos, sin in (
                    rotary_axis_table(d, n, self.config.rope_theta)
                    for d, n in zip(self.config.axes_dim_rope, self.config.axes_lens)
                )
            ]
        return self._rope_cache[device]

    def _rope(self, position_ids: torch.Tensor, check: bool = True) -> torch.Tensor:
        """position_ids long `(batch, seq, 3)` -> complex64 rotations `(batch, seq, head_dim / 2)`.

        With `check` the positions are compared to `axes_lens` on the device (one host sync); the
        forward pass checks them on the host instead and passes `check=False`.

        Raises:
            ValueError: if a position is outside its axis table (`axes_lens`).
        """
        if check:
            limits = torch.tensor(self.config.axes_lens, device=position_ids.device)
            if position_ids.numel() and bool((position_ids.reshape(-1, 3).amax(dim=0) >= limits).any()):
                raise ValueError(f"a rotary position exceeds axes_lens {list(self.config.axes_lens)}")
        tables = self._rope_tables(position_ids.device)
        cos = torch.cat([tables[i][0][position_ids[..., i]] for i in range(3)], dim=-1)
        sin = torch.cat([tables[i][1][position_ids[..., i]] for i in range(3)], dim=-1)
        return torch.complex(cos, sin)

    # -- forward ----------------------------------------------------------------------------------

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        text_hidden_states: torch.Tensor,
        text_attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Predict the velocity `d x / d t` (t = 0 noise, t = 1 data): `embed`, every joint layer
        (`run_layers`), `unpatchify`.

        Args:
            hidden_states: latents `(batch, in_channels, h, w)`, h and w multiples of `patch_size`.
            timestep: float `(batch,)` in [0, 1].
            text_hidden_states: conditions `(batch, cond_len, llm_hidden_size)`; `cond_len` may be 0.
            text_attention_mask: bool `(batch, cond_len)`, True = real row. Real rows must come first
                (right padding), as upstream assumes; padding never influences real rows.

        Returns:
            velocity `(batch, out_channels, h, w)` in the model dtype. On the CPU (float32) each
            element's velocity is bit-identical whatever else is in the batch and however much
            padding it carries (`modules.ROW_QUANTUM`).

        Raises:
            ValueError: on mismatched shapes, a mask that is not right-padded, or sizes not divisible by
                the patch size.
        """
        batch = self.embed(hidden_states, timestep, text_hidden_states, text_attention_mask)
        return self.unpatchify(self.run_layers(batch, 0, len(self.layers)))

    def _host_lengths(self, hidden_states, timestep, text_hidden_states, text_attention_mask,
                      caption_lengths: list[int] | None = None) -> list[int]:
        """Check the inputs of `forward` (see there) and return the caption lengths on the host: the
        caller's ``caption_lengths`` (no host sync), else read from the mask (one host sync for the
        lengths and the right-padding check together)."""
        batch, _, height, width = hidden_states.shape
        p = self.config.patch_size
        if height % p or width % p:
            raise ValueError(f"latent size {height}x{width} is not a multiple of patch_size {p}")
        if text_hidden_states.shape[:2] != text_attention_mask.shape or text_hidden_states.shape[0] != batch:
            raise ValueError(
                f"text_hidden_states {tuple(text_hidden_states.shape)} / mask {tuple(text_attention_mask.shape)} "
                f"do not match batch {batch}"
            )
        if timestep.shape != (batch,):
            raise ValueError(f"timestep must have shape ({batch},), got {tuple(timestep.shape)}")
        if caption_lengths is not None:
            cap_lens_host = [int(n) for n in caption_lengths]
            if len(cap_lens_host) != batch or not all(0 <= n <= text_attention_mask.shape[1] for n in cap_lens_host):
                raise ValueError(f"caption_lengths {cap_lens_host} do not fit the mask {tuple(text_attention_mask.shape)}")
        else:
            cap_lens_host = right_padded_lengths(text_attention_mask, "text_attention_mask")
        # rotary range check on the host: caption row i -> (i, i, i), image patch -> (cap_len, r, c)
        h_tokens, w_tokens = height // p, width // p
        max_cap = max(cap_lens_host, default=0)
        axes_lens = list(self.config.axes_lens)
        if (max_cap and max_cap - 1 >= min(axes_lens)) or (h_tokens * w_tokens and (
            max_cap > limits.max_caption_rows(axes_lens) or h_tokens - 1 >= axes_lens[1] or w_tokens - 1 >= axes_lens[2]
        )):
            raise ValueError(f"a rotary position exceeds axes_lens {axes_lens}")
        return cap_lens_host

    def refine_image(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The image side of `embed`: the time embedding, the patch embedding and the noise refiner.

        It reads the latents and the timestep only, so the CFG branches of one request can share it
        (`stage_dit.denoise`). Upstream gives every patch of an element the rotary position
        ``(cap_len, r, c)`` in the refiner too; the first axis is the same for all of the element's
        patches and the refiner attends among them only, so it cancels in every query-key product
        (a common rotation): here it is 0, the same function of the inputs with one rounding fewer
        (`tests/unit/test_dit_fidelity.py` holds it to upstream's reference outputs).

        Args:
            hidden_states: latents `(batch, in_channels, h, w)` (checked by the caller, `embed`).
            timestep: float `(batch,)`.

        Returns:
            `(x, temb)`: refined patches `(batch, round_up(h w / patch_size²), hidden)` (padding rows
            after each element's patches) and the time embedding `(round_up(batch), temb_dim)` (rows
            past `batch` are padding: the adaLN GEMMs' rows).
        """
        batch, _, height, width = hidden_states.shape
        p = self.config.patch_size
        device = hidden_states.device
        h_tokens, w_tokens = height // p, width // p
        num_img = h_tokens * w_tokens
        temb = self.time_caption_embed.time(pad_rows(timestep.to(device), round_up(batch)))
        # patchify `c (h p1) (w p2) -> (h w) (p1 p2 c)`, pad the patches, embed
        x = hidden_states.to(self.x_embedder.weight.dtype).reshape(batch, -1, h_tokens, p, w_tokens, p)
        x = x.permute(0, 2, 4, 3, 5, 1).reshape(batch, num_img, -1)
        img_rows = round_up(num_img)
        x = self.x_embedder(pad_rows(x, img_rows, dim=1))
        positions = self._image_positions(torch.zeros(batch, dtype=torch.long, device=device), h_tokens, w_tokens)
        img_rope = self._rope(positions, check=False)
        img_lengths = None if img_rows == num_img else [num_img] * batch
        for block in self.noise_refiner:
            x = block(x, None, img_rope, temb, key_lengths=img_lengths)
        return x, temb

    @staticmethod
    def _image_positions(cap_lens: torch.Tensor, h_tokens: int, w_tokens: int) -> torch.Tensor:
        """Rotary positions of the image patches, long `(batch, round_up(h w), 3)`: patch (r, c) of
        element i -> (cap_lens[i], r, c); padding rows after them."""
        batch, num_img, device = cap_lens.shape[0], h_tokens * w_tokens, cap_lens.device
        rows = torch.arange(h_tokens, device=device).repeat_interleave(w_tokens)
        cols = torch.arange(w_tokens, device=device).repeat(h_tokens)
        img_pos = torch.stack(
            [cap_lens[:, None].expand(batch, num_img), rows.expand(batch, -1), cols.expand(batch, -1)], dim=-1
        )
        return pad_rows(img_pos, round_up(num_img), dim=1)

    def embed(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        text_hidden_states: torch.Tensor,
        text_attention_mask: torch.Tensor,
        caption_lengths: list[int] | None = None,
        refined: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> "JointBatch":
        """Steps 1-5 of `forward` (arguments and errors as there): the joint sequence before the
        joint layers. Every row count is padded to `modules.ROW_QUANTUM` (captions, image patches,
        the joint sequence, the timestep batch); padding rows are never attended to. The caller's
        ``caption_lengths`` (host ints, each mask row's real rows) save reading them from the mask;
        ``refined``: `refine_image`'s `(x, temb)` for these elements, computed once for the CFG
        branches of a request (None: computed here)."""
        cap_lens_host = self._host_lengths(hidden_states, timestep, text_hidden_states, text_attention_mask,
                                           caption_lengths)
        batch, _, height, width = hidden_states.shape
        p = self.config.patch_size
        device = hidden_states.device
        h_tokens, w_tokens = height // p, width // p
        num_img = h_tokens * w_tokens
        cond_len = round_up(text_hidden_states.shape[1])
        text_mask = pad_rows(text_attention_mask.to(device, torch.bool), cond_len, dim=1)
        text = pad_rows(text_hidden_states.to(device, self.x_embedder.weight.dtype), cond_len, dim=1)
        cap_lens = text_mask.sum(dim=1)  # on the device, = cap_lens_host (no host-to-device copy)

        # 1-2. Time and patch embedding, the noise refiner (modulated, over the image patches)
        x, temb = self.refine_image(hidden_states, timestep) if refined is None else refined
        if x.shape[:2] != (batch, round_up(num_img)) or temb.shape[0] != round_up(batch):
            raise ValueError(f"refined rows {tuple(x.shape)} / temb {tuple(temb.shape)} do not match batch {batch} "
                             f"of {num_img} patches")

        # 3. Caption embedding, rotary positions: caption row i -> (i, i, i); image patch (r, c) -> (cap_len, r, c)
        caption = self.time_caption_embed.caption(text)
        arange_cond = torch.arange(cond_len, device=device)
        cap_pos = arange_cond[None, :, None].expand(batch, cond_len, 3) * text_mask[..., None]
        img_pos = self._image_positions(cap_lens, h_tokens, w_tokens)
        img_rows = img_pos.shape[1]

        # 4. Refine the caption (unmodulated)
        cap_rope = self._rope(cap_pos, check=False)
        # padding is always on the right: attend over each element's real keys (flash on CUDA)
        cap_lengths = None if all(n == cond_len for n in cap_lens_host) else cap_lens_host
        for block in self.context_refiner:
            caption = block(caption, None, cap_rope, key_lengths=cap_lengths)

        # 5. Joint sequence per element: [its cap_len caption rows; image patches; padding]
        joint_len = round_up(max(cap_lens_host, default=0) + num_img)
        j = torch.arange(joint_len, device=device)[None, :]
        lens = cap_lens[:, None]
        joint_mask = j < lens + num_img
        source = torch.where(j < lens, j, cond_len + (j - lens)).clamp(max=cond_len + img_rows - 1)
        source = torch.where(joint_mask, source, torch.zeros_like(source))
        joint = torch.gather(torch.cat([caption, x], dim=1), 1, source[..., None].expand(-1, -1, x.shape[-1]))
        joint_pos = torch.gather(torch.cat([cap_pos, img_pos], dim=1), 1, source[..., None].expand(-1, -1, 3))
        joint_rope = self._rope(joint_pos * joint_mask[..., None], check=False)
        return JointBatch(joint, temb, joint_rope, [n + num_img for n in cap_lens_host], cap_lens, h_tokens, w_tokens)

    def run_layers(self, batch: "JointBatch", start: int, stop: int) -> "JointBatch":
        """Joint layers ``start`` .. ``stop - 1`` over ``batch``; returns it with the new ``joint``."""
        joint_len = batch.joint.shape[1]
        key_lengths = None if all(n == joint_len for n in batch.real_rows) else batch.real_rows
        joint = batch.joint
        for block in self.layers[start:stop]:
            joint = block(joint, None, batch.rope, batch.temb, key_lengths=key_lengths)
        return replace(batch, joint=joint)

    def unpatchify(self, batch: "JointBatch") -> torch.Tensor:
        """Steps 6-7 of `forward`: output norm and projection, each element's image rows, unpatchified
        `(h w) (p1 p2 c) -> c (h p1) (w p2)`: velocity `(batch, out_channels, h, w)`."""
        p = self.config.patch_size
        out = self.norm_out(batch.joint, batch.temb)
        b, h, w = out.shape[0], batch.h_tokens, batch.w_tokens
        img_index = batch.cap_lens[:, None] + torch.arange(h * w, device=out.device)[None, :]
        out = torch.gather(out, 1, img_index[..., None].expand(-1, -1, out.shape[-1]))
        out = out.view(b, h, w, p, p, self.out_channels)
        return out.permute(0, 5, 1, 3, 2, 4).reshape(b, self.out_channels, h * p, w * p)


@dataclass
class JointBatch:
    """A batch between `MammothTransformer2DModel.embed` and `unpatchify`.

    Attributes:
        joint: `(batch, joint_len, hidden)`, element i's real rows first (`real_rows[i]` of them:
            its caption rows, then its image patches), then padding.
        temb: `(round_up(batch), temb_dim)` time embedding (rows past `batch` are padding).
        rope: complex64 `(batch, joint_len, head_dim / 2)`.
        real_rows: host ints, real rows per element.
        cap_lens: long `(batch,)` caption rows per element, on the device.
        h_tokens, w_tokens: image patches per column / row.
    """

    joint: torch.Tensor
    temb: torch.Tensor
    rope: torch.Tensor
    real_rows: list[int]
    cap_lens: torch.Tensor
    h_tokens: int
    w_tokens: int

    def select(self, index: list[int]) -> "JointBatch":
        """The elements ``index`` (host ints, in that order) as a batch of their own (the time
        embedding re-padded to `modules.ROW_QUANTUM` rows)."""
        sel = torch.tensor(index, device=self.joint.device, dtype=torch.long)
        temb = pad_rows(self.temb[sel], round_up(len(index)))
        return JointBatch(self.joint[sel], temb, self.rope[sel], [self.real_rows[i] for i in index],
                          self.cap_lens[sel], self.h_tokens, self.w_tokens)
