"""From AR hidden states to the DiT condition (the AR -> DiT contract of docs/MODEL.md).

The AR stage forwards one hidden row per token (prompt, then generated grid). The DiT stage splits
them once per request:

* text rows: position < `answer_start_index`, id neither a vision placeholder (`image_token_id`,
  `video_token_id`, `vision_start_token_id`, `vision_end_token_id`) nor a generation id;
* image rows: position >= `answer_start_index` and id >= `gen_vocab_start_index` (visual codes, EOLs
  and any other generation special);

then builds the condition per `gen_condition_mode`: `image` = the image rows refined by the Q-Former
(upstream's config-class default); `text_image` = text rows followed by the refined queries. This
mirrors upstream `t2i_utils.encode_full_prompts` (commit 2317bbce) and vllm-omni's DiT-side split.
The negative (CFG) condition is not built here: it is the raw AR hidden rows of the negative prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import nn


class AnswerBoundaryRule(str, Enum):
    """Where the "answer" (image part) of the AR rows starts.

    * `prompt_length` (default; vllm-omni): the first generated row, `answer_start_index = num_prompt_rows`.
    * `last_10` (upstream Preview demo `decode_diffusion_image`): only the last 10 rows are answer,
      `total_rows - 10`, where the demo's rows are prompt + generated + an appended `<|image end|>`.
    * `prompt_minus_10` (upstream's later code): `num_prompt_rows - 10`.
    """

    PROMPT_LENGTH = "prompt_length"
    LAST_10 = "last_10"
    PROMPT_MINUS_10 = "prompt_minus_10"


class ConditionMode(str, Enum):
    """`gen_condition_mode` of the checkpoint config."""

    IMAGE = "image"
    TEXT_IMAGE = "text_image"


def compute_answer_start_index(
    num_prompt_rows: int, total_rows: int, rule: AnswerBoundaryRule | str = AnswerBoundaryRule.PROMPT_LENGTH
) -> int:
    """Answer boundary for one request.

    Args:
        num_prompt_rows: rows of the prompt (before the first generated token).
        total_rows: all rows the AR forwarded (prompt + generated [+ appended end token]).
        rule: an `AnswerBoundaryRule` or its value.

    Returns:
        index in `[0, total_rows]`; rules that would go below 0 are clamped to 0.

    Raises:
        ValueError: on an unknown rule or `0 <= num_prompt_rows <= total_rows` violated.
    """
    try:
        rule = AnswerBoundaryRule(rule)
    except ValueError:
        names = ", ".join(r.value for r in AnswerBoundaryRule)
        raise ValueError(f"unknown answer boundary rule {rule!r}; expected one of: {names}") from None
    if not 0 <= num_prompt_rows <= total_rows:
        raise ValueError(f"need 0 <= num_prompt_rows ({num_prompt_rows}) <= total_rows ({total_rows})")
    if rule is AnswerBoundaryRule.PROMPT_LENGTH:
        return num_prompt_rows
    if rule is AnswerBoundaryRule.LAST_10:
        return max(0, total_rows - 10)
    return max(0, num_prompt_rows - 10)


@dataclass(frozen=True)
class ConditionTokenIds:
    """Token ids the split needs, read from the checkpoint's `llm_config`.

    Attributes:
        gen_vocab_start_index: first generation id (ids at or above it are generation ids).
        vision_token_ids: the vision placeholders excluded from the text condition
            (image, video, vision start, vision end).
    """

    gen_vocab_start_index: int
    vision_token_ids: tuple[int, ...]

    @classmethod
    def from_llm_config(cls, llm_config: dict[str, Any]) -> ConditionTokenIds:
        """Read the ids from `llm_config` (flat upstream layout; a nested `text_config` is a fallback).

        `gen_vocab_start_index` missing or null means `vocab_size` (upstream's default). Placeholder
        ids that are missing default to the Qwen2.5-VL values (151655, 151656, 151652, 151653).

        Raises:
            ValueError: if neither `gen_vocab_start_index` nor `vocab_size` is present.
        """
        text = llm_config.get("text_config") or {}

        def read(key: str, default: Any = None) -> Any:
            value = llm_config.get(key)
            if value is None:
                value = text.get(key)
            return default if value is None else value

        start = read("gen_vocab_start_index", read("vocab_size"))
        if start is None:
            raise ValueError("llm_config has neither gen_vocab_start_index nor vocab_size")
        defaults = {
            "image_token_id": 151655,
            "video_token_id": 151656,
            "vision_start_token_id": 151652,
            "vision_end_token_id": 151653,
        }
        return cls(int(start), tuple(int(read(k, d)) for k, d in defaults.items()))


@dataclass(frozen=True)
class ConditionRows:
    """Row indices (int64, ascending) of the text and image conditions within the AR rows."""

    text_index: torch.Tensor
    image_index: torch.Tensor


def split_condition_rows(
    token_ids: torch.Tensor, answer_start_index: int, token_config: ConditionTokenIds
) -> ConditionRows:
    """Select the text and image condition rows.

    Args:
        token_ids: int `(rows,)`, prompt then generated ids.
        answer_start_index: first answer position (see `compute_answer_start_index`).
        token_config: ids from the checkpoint config.

    Returns:
        `ConditionRows` with ascending positions.

    Raises:
        ValueError: if `token_ids` is not 1-D, the boundary is outside `[0, rows]`, or there is no image row.
    """
    if token_ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    rows = token_ids.shape[0]
    if not 0 <= answer_start_index <= rows:
        raise ValueError(f"answer_start_index {answer_start_index} outside [0, {rows}]")
    ids = token_ids.to(torch.long)
    position = torch.arange(rows, device=ids.device)
    is_gen = ids >= token_config.gen_vocab_start_index
    is_vision = torch.isin(ids, torch.tensor(token_config.vision_token_ids, dtype=torch.long, device=ids.device))
    text = (position < answer_start_index) & ~(is_vision | is_gen)
    image = (position >= answer_start_index) & is_gen
    if not bool(image.any()):
        raise ValueError(
            f"no image-condition rows: no generation token (id >= {token_config.gen_vocab_start_index}) "
            f"at or after answer_start_index {answer_start_index} of {rows} rows"
        )
    return ConditionRows(text.nonzero().flatten(), image.nonzero().flatten())


def build_condition(
    hidden_states: torch.Tensor,
    token_ids: torch.Tensor,
    answer_start_index: int,
    *,
    token_config: ConditionTokenIds,
    refiner: nn.Module | None,
    mode: ConditionMode | str = ConditionMode.TEXT_IMAGE,
) -> torch.Tensor:
    """The positive DiT condition of one request.

    Args:
        hidden_states: AR post-norm hidden rows `(rows, llm_hidden)`, any float dtype.
        token_ids: int `(rows,)`.
        answer_start_index: see `compute_answer_start_index`.
        token_config: ids from the checkpoint config.
        refiner: the `SimpleQFormerImageRefiner`, or None (upstream then uses the raw image rows).
        mode: `image` -> refined queries `(num_queries, H)`; `text_image` -> text rows then refined
            queries `(text_rows + num_queries, H)`.

    Returns:
        condition `(cond_len, llm_hidden)` in the refiner's dtype (or the input dtype without refiner),
        on `hidden_states.device`.

    Raises:
        ValueError: on a shape mismatch, an unknown mode, or no image rows.
    """
    try:
        mode = ConditionMode(mode)
    except ValueError:
        raise ValueError(f"unknown gen_condition_mode {mode!r}; expected 'image' or 'text_image'") from None
    if hidden_states.ndim != 2 or hidden_states.shape[0] != token_ids.shape[0]:
        raise ValueError(
            f"hidden_states {tuple(hidden_states.shape)} must be (rows, hidden) with rows = len(token_ids) "
            f"({token_ids.shape[0]})"
        )
    split = split_condition_rows(token_ids.to(hidden_states.device), answer_start_index, token_config)
    image_rows = hidden_states[split.image_index]
    if refiner is not None:
        image_rows = refiner(image_rows[None])[0]
    parts = [image_rows]
    if mode is ConditionMode.TEXT_IMAGE:
        parts.insert(0, hidden_states[split.text_index].to(image_rows.dtype))
    return torch.cat(parts, dim=0)
