"""Configuration of the MammothModa2 autoregressive (AR) stage.

`MammothARConfig.from_dict` reads the checkpoint's ``llm_config`` in upstream's layout
(``bytedance/mammothmoda`` @ 2317bbce, ``Mammothmoda2Qwen2_5_VLConfig``): the Qwen2.5 text fields sit
at the top level of ``llm_config`` ("flat" layout, the one ``save_pretrained`` writes); a nested
``text_config`` dict, when present, wins for text fields, exactly as upstream builds its text model
from ``config.text_config``. Vision-token ids are read from the top level (they belong to the
wrapper config upstream).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MammothARConfig", "parse_moe_type"]

_MOE_KINDS = ("none", "attention", "ffn", "ffn_attention")
_MOE_RE = re.compile(r"^(?P<kind>[a-z_]+)(?:-(?P<start>\d+):(?P<end>\d+))?$")


def parse_moe_type(moe_type: str, num_hidden_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Parse upstream's ``moe_type`` into the layers that own generation experts.

    Format (upstream ``moe_enable``): ``none|attention|ffn|ffn_attention[-start:end]``, e.g.
    ``"ffn_attention-14:28"`` = layers 14..27. Without a range every layer is an expert layer.
    Upstream tests ``layer_type in kind`` as a substring, so ``ffn_attention`` enables both the
    attention projections (``gen_{q,k,v,o}_proj``) and the MLP (``gen_mlp``).

    Returns:
        ``(attention_layers, ffn_layers)``: sorted layer indices.

    Raises:
        ValueError: unknown kind, malformed range, or ``start > end``.
    """
    match = _MOE_RE.match(moe_type.strip())
    if match is None or match["kind"] not in _MOE_KINDS:
        raise ValueError(f"moe_type {moe_type!r} is not none|attention|ffn|ffn_attention[-start:end]")
    kind = match["kind"]
    if match["start"] is not None:
        start, end = int(match["start"]), int(match["end"])
        if start > end:
            raise ValueError(f"moe_type {moe_type!r}: start {start} > end {end}")
    else:
        start, end = 0, num_hidden_layers
    layers = tuple(i for i in range(num_hidden_layers) if start <= i < end)
    attention_layers = layers if "attention" in kind else ()
    ffn_layers = layers if "ffn" in kind else ()
    return attention_layers, ffn_layers


@dataclass
class MammothARConfig:
    """Hyper-parameters of the Qwen2.5 text decoder with MammothModa2 generation experts.

    Defaults are the Qwen2.5-VL-7B text dimensions with MammothModa2's vocabulary; real values always
    come from the checkpoint's ``llm_config`` via `from_dict`.

    Attributes:
        vocab_size: base vocabulary (rows of ``embed_tokens`` and ``lm_head``).
        gen_vocab_size: rows of ``gen_embed_tokens`` / ``gen_head``.
        gen_vocab_start_index: first generation id; ids ``>=`` it use the generation embedding, head
            and experts. ``None`` in the file means ``vocab_size`` (upstream, ``extra_gen_vocab``) or
            ``vocab_size - gen_vocab_size`` (without ``extra_gen_vocab``).
        moe_type: upstream string; `attention_expert_layers`/`ffn_expert_layers` hold its meaning.
        head_dim: ``hidden_size // num_attention_heads`` (upstream has no separate field).
    """

    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 128000
    vocab_size: int = 152064
    gen_vocab_size: int = 32800
    gen_vocab_start_index: int | None = None
    extra_gen_vocab: bool = True
    moe_type: str = "ffn_attention-14:28"
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    attention_expert_layers: tuple[int, ...] = field(init=False, default=())
    ffn_expert_layers: tuple[int, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (Qwen2.5 uses silu)")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings=True is not supported: MammothModa2 has separate lm_head weights")
        if self.gen_vocab_start_index is None:
            self.gen_vocab_start_index = (
                self.vocab_size if self.extra_gen_vocab else self.vocab_size - self.gen_vocab_size
            )
        self.attention_expert_layers, self.ffn_expert_layers = parse_moe_type(self.moe_type, self.num_hidden_layers)

    @property
    def head_dim(self) -> int:
        """Per-head width: ``hidden_size // num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads

    @property
    def full_vocab_size(self) -> int:
        """Width of the logits: ``vocab_size + gen_vocab_size`` (or ``vocab_size`` without extra vocab)."""
        return self.vocab_size + (self.gen_vocab_size if self.extra_gen_vocab else 0)

    @classmethod
    def from_dict(cls, llm_config: dict[str, Any]) -> MammothARConfig:
        """Build the config from upstream's ``llm_config`` dict.

        Args:
            llm_config: the ``llm_config`` object of the checkpoint's ``config.json``. Flat layout
                (text fields top-level) and nested ``text_config`` are both accepted; nested values
                win, as upstream constructs its language model from ``text_config``.

        Raises:
            TypeError: ``llm_config`` is not a dict.
            ValueError: missing ``hidden_size`` in both places, sliding-window attention, an
                unsupported RoPE type, or any check of `__post_init__`.
        """
        if not isinstance(llm_config, dict):
            raise TypeError(f"llm_config must be a dict, got {type(llm_config).__name__}")
        nested = llm_config.get("text_config")
        text: dict[str, Any] = dict(llm_config)
        if isinstance(nested, dict):
            text.update({k: v for k, v in nested.items() if v is not None})
        if "hidden_size" not in text:
            raise ValueError("llm_config has no hidden_size (neither flat nor in text_config)")
        if text.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported (MammothModa2-Preview does not use it)")
        rope_scaling = text.get("rope_scaling") or {}
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ValueError(f"rope type {rope_type!r} is not supported (only default/mrope)")

        names = {f.name for f in dataclasses.fields(cls) if f.init}
        kwargs = {k: v for k, v in text.items() if k in names}
        # Token ids of the vision placeholders live on the wrapper config (top level) upstream.
        for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            if llm_config.get(key) is not None:
                kwargs[key] = llm_config[key]
            elif kwargs.get(key) is None:
                kwargs.pop(key, None)
        return cls(**kwargs)
