"""Image-condition refiner (`gen_image_condition_refiner.*`): a small Q-Former.

Maps a variable number of AR image-condition rows to a fixed number of learnable query tokens, as
upstream's `SimpleQFormerImageRefiner` (`mammothmoda2_dit/image_embedder.py`, commit 2317bbce).
Attribute paths equal the checkpoint keys (`input_proj.{0,1}`, `query`,
`layers.N.{ln_q1,self_attn,ln_q2,cross_attn,ln_ffn,ffn}`).
"""

from __future__ import annotations

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from stage_dit.modules import RMSNorm, SwiGLUFeedForward


def choose_num_heads(hidden_size: int, proposed: int | None, preferred_head_dim: int = 128) -> int:
    """Number of attention heads, as upstream picks it.

    `proposed` (default `max(1, hidden_size // 128)`) is kept when it divides `hidden_size`; otherwise
    the divisor of `hidden_size` (at most 128) nearest to `hidden_size / preferred_head_dim`, larger on
    ties.
    """
    if proposed is None:
        proposed = max(1, hidden_size // preferred_head_dim)
    if proposed > 0 and hidden_size % proposed == 0:
        return proposed
    target = max(1, round(hidden_size / preferred_head_dim))
    divisors = [d for d in range(1, min(128, hidden_size) + 1) if hidden_size % d == 0]
    return min(divisors, key=lambda d: (abs(d - target), -d))


class QFormerLayer(nn.ModuleDict):
    """One refiner layer: pre-normed self-attention, cross-attention and SwiGLU FFN, each residual.

    Both attentions are `torch.nn.MultiheadAttention(batch_first=True)` (packed `in_proj_weight`,
    biases); the FFN is the Lumina2 SwiGLU with nominal width `4 * hidden` rounded up to 256.
    """

    def __init__(self, hidden_size: int, num_heads: int, dropout: float, norm_eps: float) -> None:
        super().__init__(
            {
                "ln_q1": RMSNorm(hidden_size, eps=norm_eps),
                "self_attn": nn.MultiheadAttention(hidden_size, num_heads, dropout=dropout, batch_first=True),
                "ln_q2": RMSNorm(hidden_size, eps=norm_eps),
                "cross_attn": nn.MultiheadAttention(hidden_size, num_heads, dropout=dropout, batch_first=True),
                "ln_ffn": RMSNorm(hidden_size, eps=norm_eps),
                "ffn": SwiGLUFeedForward(hidden_size, 4 * hidden_size, multiple_of=256),
            }
        )

    def forward(self, query: torch.Tensor, kv: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        """query `(batch, num_queries, hidden)`, kv `(batch, rows, hidden)`, mask bool `(batch, rows)`
        True = padding (PyTorch's `key_padding_mask` convention) -> `(batch, num_queries, hidden)`."""
        q = self["ln_q1"](query)
        query = query + self["self_attn"](q, q, q, need_weights=False)[0]
        q = self["ln_q2"](query)
        query = query + self["cross_attn"](q, kv, kv, need_weights=False, key_padding_mask=key_padding_mask)[0]
        return query + self["ffn"](self["ln_ffn"](query))


class SimpleQFormerImageRefiner(ModelMixin, ConfigMixin):
    """Q-Former over the AR image-condition rows.

    `kv = Linear(RMSNorm(x))`; the learnable `query` `(1, num_queries, hidden)` then runs through
    `num_layers` `QFormerLayer`s.

    Args:
        hidden_size: AR hidden width (input and output width).
        num_queries: output tokens (upstream default 128).
        num_layers: refiner layers.
        num_heads: attention heads; None or a non-divisor is resolved by `choose_num_heads`.
        dropout: attention dropout (inference: 0).
        norm_eps: eps of every RMSNorm.
    """

    @register_to_config
    def __init__(
        self,
        hidden_size: int,
        num_queries: int = 128,
        num_layers: int = 2,
        num_heads: int | None = None,
        dropout: float = 0.0,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.num_heads = choose_num_heads(hidden_size, num_heads)
        self.input_proj = nn.Sequential(
            RMSNorm(hidden_size, eps=norm_eps), nn.Linear(hidden_size, hidden_size, bias=True)
        )
        self.query = nn.Parameter(torch.randn(1, num_queries, hidden_size) * hidden_size**-0.5)
        self.layers = nn.ModuleList(
            QFormerLayer(hidden_size, self.num_heads, dropout, norm_eps) for _ in range(num_layers)
        )

    def forward(self, hidden_states: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Refine image-condition rows into query tokens.

        Args:
            hidden_states: `(batch, rows, hidden_size)`, rows >= 1.
            key_padding_mask: bool `(batch, rows)`, True = padding row to ignore; None = no padding.

        Returns:
            `(batch, num_queries, hidden_size)` in the module dtype.

        Raises:
            ValueError: if there are no rows (nothing to attend to).
        """
        if hidden_states.shape[1] == 0:
            raise ValueError("the image-condition refiner needs at least one row")
        dtype = self.query.dtype
        kv = self.input_proj(hidden_states.to(dtype))
        query = self.query.expand(hidden_states.shape[0], -1, -1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.to(device=kv.device, dtype=torch.bool)
        for layer in self.layers:
            query = layer(query, kv, key_padding_mask)
        return query
