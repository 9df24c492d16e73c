"""Hard routing of tokens between the understanding and the generation experts of the MammothModa2
AR (upstream ``moe_forward``): which tokens of a forward go where (`ExpertRouting`, computed once
per forward), and running an expert pair over them (`route_experts`, `single_expert`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ExpertRouting", "route_experts", "single_expert"]


@dataclass
class ExpertRouting:
    """Which tokens of one forward go to the generation experts, computed once per forward.

    Attributes:
        gen_token_mask: bool ``(batch, seq)``, True for ids ``>= gen_vocab_start_index`` (None for
            `all_generation`, which needs no mask).
        mode: ``"none"`` (no generation token), ``"all"`` (only generation tokens) or ``"mixed"``.
        gen_index, und_index: flat token indices of each group (``"mixed"`` only).
    """

    gen_token_mask: torch.Tensor | None
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

    @classmethod
    def all_generation(cls, input_ids: torch.Tensor) -> ExpertRouting:
        """Every token is a generation token (grid decode): no host sync, no kernel, capturable."""
        return cls(None, "all")


def single_expert(und_expert: Any, gen_expert: Any | None, routing: ExpertRouting | None) -> Any | None:
    """The expert every token of the forward goes to (`route_experts`' rule), or None when the
    tokens are split between the two (``"mixed"``)."""
    if gen_expert is None or routing is None or routing.mode == "none":
        return und_expert
    return gen_expert if routing.mode == "all" else None


def route_experts(
    hidden_states: torch.Tensor,
    und_expert: Callable[[torch.Tensor], torch.Tensor],
    gen_expert: Callable[[torch.Tensor], torch.Tensor] | None,
    routing: ExpertRouting | None,
    *args: Any,
) -> torch.Tensor:
    """Hard routing between the understanding and the generation expert (upstream ``moe_forward``).

    Args:
        hidden_states: ``(batch, seq, in_features)``.
        und_expert: module for non-generation tokens.
        gen_expert: module for generation tokens; ``None`` (non-expert layer) routes all to
            ``und_expert``.
        routing: the forward's `ExpertRouting`; ``None`` routes all to ``und_expert``.
        args: passed to the expert after the tokens.

    Returns:
        ``(batch, seq, out_features)`` in token order. Each token's output depends only on that token
        and its expert, so the result equals upstream's permute/split/inverse-permute.
    """
    expert = single_expert(und_expert, gen_expert, routing)
    if expert is not None:
        return expert(hidden_states, *args)
    batch, seq, _ = hidden_states.shape
    flat = hidden_states.reshape(batch * seq, -1)
    gen_out = gen_expert(flat.index_select(0, routing.gen_index), *args)
    und_out = und_expert(flat.index_select(0, routing.und_index), *args)
    out = gen_out.new_empty(batch * seq, gen_out.shape[-1])
    out.index_copy_(0, routing.gen_index, gen_out)
    out.index_copy_(0, routing.und_index, und_out)
    return out.view(batch, seq, -1)
