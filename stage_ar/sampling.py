"""Grid-constrained, seeded sampling of MammothModa2 image tokens.

The AR writes an image as ``ar_height`` rows of ``ar_width`` visual codes each followed by one
``<|endofline|>`` (EOL). With ``col = generated_len % (ar_width + 1)``: at ``col == ar_width`` only EOL is
allowed, otherwise only visual codes ``[visual_token_start_id, visual_token_end_id)`` (vllm-omni
``_apply_t2i_token_constraints``; upstream ``generate_t2i`` forces EOL the same way).

Logit processing follows upstream ``Mammothmoda2Model.generate_t2i``: (AR-CFG mix, done by the
caller) -> repetition penalty -> temperature -> vocabulary restriction -> top-k -> top-p (top-k and
top-p keep at least 3 tokens) -> sample. Randomness comes from a CPU ``torch.Generator`` seeded per
request, drawn as one uniform per sample (inverse-CDF), so the random stream is the same on every
device.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["GridConstrainedSampler", "T2IGenerationConfig", "read_t2i_generation_config"]

T2I_GENERATION_CONFIG_FILE = "t2i_generation_config.json"
MIN_TOKENS_TO_KEEP = 3  # upstream generate_t2i: TopK/TopP warpers with min_tokens_to_keep=3


@dataclass
class T2IGenerationConfig:
    """Contents of ``t2i_generation_config.json`` that the AR uses.

    Attributes:
        eol_token_id: ``<|endofline|>`` id.
        visual_token_start_id: first visual-code id.
        visual_token_end_id: one past the last visual-code id (exclusive, vllm-omni's reading;
            upstream ``generate_t2i`` instead computes ``start + visual_token_end_id`` — see
            docs/MODEL_DIFFERENCES.md).
        temperature, top_k, top_p, repetition_penalty, do_sample: sampling defaults
            (``top_k`` 0/None = off, ``top_p`` 1.0 = off, ``do_sample`` False = greedy).
        extra: every other key of the file, unchanged.
    """

    eol_token_id: int
    visual_token_start_id: int
    visual_token_end_id: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    do_sample: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.visual_token_start_id < self.visual_token_end_id:
            raise ValueError(
                f"visual token range [{self.visual_token_start_id}, {self.visual_token_end_id}) is empty or negative"
            )
        if self.visual_token_start_id <= self.eol_token_id < self.visual_token_end_id:
            raise ValueError(f"eol_token_id {self.eol_token_id} lies inside the visual-code range")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict in the file's layout (``extra`` keys merged at the top level)."""
        data = asdict(self)
        extra = data.pop("extra")
        return {**extra, **data}


def read_t2i_generation_config(directory: str | Path) -> T2IGenerationConfig:
    """Read ``t2i_generation_config.json`` from a checkpoint directory.

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: a required id is missing or the values are inconsistent.
    """
    path = Path(directory) / T2I_GENERATION_CONFIG_FILE
    data = json.loads(path.read_text(encoding="utf-8"))
    missing = [k for k in ("eol_token_id", "visual_token_start_id", "visual_token_end_id") if data.get(k) is None]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    known = {
        "eol_token_id",
        "visual_token_start_id",
        "visual_token_end_id",
        "temperature",
        "top_k",
        "top_p",
        "repetition_penalty",
        "do_sample",
    }
    kwargs: dict[str, Any] = {k: data[k] for k in known if data.get(k) is not None}
    return T2IGenerationConfig(**kwargs, extra={k: v for k, v in data.items() if k not in known})


class GridConstrainedSampler:
    """Samples one request's grid tokens.

    Args:
        ar_width, ar_height: grid size in tokens (image size // 16).
        eol_token_id: the ``<|endofline|>`` id.
        visual_token_start_id, visual_token_end_id: visual codes ``[start, end)`` (end exclusive).
        temperature: > 0 divides the logits; ``<= 0`` means greedy (argmax).
        top_k: keep the ``max(top_k, 3)`` largest logits (ties kept); ``None``/0 = off.
        top_p: nucleus threshold in ``(0, 1]``; 1.0 = off.
        generator: CPU ``torch.Generator`` seeded with the request seed (one uniform per sample).
        repetition_penalty: upstream/HF repetition penalty over the ids seen so far; 1.0 = off.
        do_sample: False = greedy regardless of temperature.

    Raises:
        ValueError: bad sizes, ranges or sampling parameters, or a non-CPU generator.
    """

    def __init__(
        self,
        ar_width: int,
        ar_height: int,
        eol_token_id: int,
        visual_token_start_id: int,
        visual_token_end_id: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
        *,
        repetition_penalty: float = 1.0,
        do_sample: bool = True,
    ) -> None:
        if ar_width < 1 or ar_height < 1:
            raise ValueError(f"grid must be at least 1x1, got {ar_width}x{ar_height}")
        if not 0 <= visual_token_start_id < visual_token_end_id:
            raise ValueError(f"empty visual token range [{visual_token_start_id}, {visual_token_end_id})")
        if visual_token_start_id <= eol_token_id < visual_token_end_id:
            raise ValueError(f"eol_token_id {eol_token_id} lies inside the visual-code range")
        if top_k is not None and top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
        if generator is None:
            generator = torch.Generator(device="cpu")
        if generator.device.type != "cpu":
            raise ValueError("the generator must be a CPU torch.Generator (same stream on every device)")
        self.ar_width = ar_width
        self.ar_height = ar_height
        self.eol_token_id = eol_token_id
        self.visual_token_start_id = visual_token_start_id
        self.visual_token_end_id = visual_token_end_id
        self.temperature = temperature
        self.top_k = top_k or None
        self.top_p = top_p
        self.generator = generator
        self.repetition_penalty = repetition_penalty
        self.greedy = (not do_sample) or temperature <= 0

    @classmethod
    def from_generation_config(
        cls, config: T2IGenerationConfig, ar_width: int, ar_height: int, seed: int, **overrides: Any
    ) -> GridConstrainedSampler:
        """Sampler with the file's ids and sampling defaults, ``overrides`` (temperature, top_k,
        top_p, repetition_penalty, do_sample) winning, and a CPU generator seeded with ``seed``."""
        params: dict[str, Any] = {
            "temperature": config.temperature,
            "top_k": config.top_k,
            "top_p": config.top_p,
            "repetition_penalty": config.repetition_penalty,
            "do_sample": config.do_sample,
        }
        params.update({k: v for k, v in overrides.items() if v is not None})
        generator = torch.Generator(device="cpu")
        generator.manual_seed(int(seed))
        return cls(
            ar_width,
            ar_height,
            config.eol_token_id,
            config.visual_token_start_id,
            config.visual_token_end_id,
            params["temperature"],
            params["top_k"],
            params["top_p"],
            generator,
            repetition_penalty=params["repetition_penalty"],
            do_sample=params["do_sample"],
        )

    @property
    def grid_tokens(self) -> int:
        """``ar_height * (ar_width + 1)`` tokens in the grid (EOLs included)."""
        return self.ar_height * (self.ar_width + 1)

    def is_eol_position(self, generated_len: int) -> bool:
        """Whether the token at index ``generated_len`` of the generated sequence must be EOL."""
        return generated_len % (self.ar_width + 1) == self.ar_width

    def sample(self, logits: torch.Tensor, generated_len: int, previous_ids: list[int] | None = None) -> int:
        """Sample the token at index ``generated_len`` of the generated sequence.

        Args:
            logits: ``(vocab,)`` float logits of the full vocabulary (base + generation), any device.
            generated_len: tokens generated before this one.
            previous_ids: ids the repetition penalty looks at (prompt + generated), if enabled.

        Returns:
            The token id. EOL positions return EOL without drawing a random number; every other
            position draws exactly one uniform from the generator when sampling (none when greedy).

        Raises:
            ValueError: ``logits`` is not 1-D or too narrow for the visual range.
        """
        if logits.dim() != 1:
            raise ValueError(f"logits must be 1-D (vocab,), got shape {tuple(logits.shape)}")
        if logits.shape[0] < self.visual_token_end_id:
            raise ValueError(f"logits width {logits.shape[0]} < visual_token_end_id {self.visual_token_end_id}")
        if self.is_eol_position(generated_len):
            return self.eol_token_id
        scores = logits.float()
        if self.repetition_penalty != 1.0 and previous_ids:
            scores = scores.clone()
            seen = torch.tensor(sorted(set(previous_ids)), device=scores.device, dtype=torch.long)
            seen = seen[seen < scores.shape[0]]
            picked = scores[seen]
            scores[seen] = torch.where(picked < 0, picked * self.repetition_penalty, picked / self.repetition_penalty)
        # Restrict to the visual codes: only this slice can be sampled (the EOL id is outside it).
        scores = scores[self.visual_token_start_id : self.visual_token_end_id]
        if self.greedy:
            return self.visual_token_start_id + int(torch.argmax(scores))
        scores = scores / self.temperature
        scores = self._top_k(scores)
        scores = self._top_p(scores)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float64)
        cdf = torch.cumsum(probs, dim=0)
        u = torch.rand((), generator=self.generator, dtype=torch.float64).item() * float(cdf[-1])
        index = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype, device=cdf.device), right=True))
        index = min(index, scores.shape[0] - 1)
        # Never land on a filtered (-inf) entry through rounding at the CDF's flat parts.
        while probs[index] == 0 and index > 0:
            index -= 1
        return self.visual_token_start_id + index

    def _top_k(self, scores: torch.Tensor) -> torch.Tensor:
        if self.top_k is None:
            return scores
        k = min(max(self.top_k, MIN_TOKENS_TO_KEEP), scores.shape[0])
        kth = torch.topk(scores, k).values[-1]
        return scores.masked_fill(scores < kth, float("-inf"))

    def _top_p(self, scores: torch.Tensor) -> torch.Tensor:
        if self.top_p >= 1.0:
            return scores
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - self.top_p)
        remove_sorted[-MIN_TOKENS_TO_KEEP:] = False
        remove = remove_sorted.scatter(0, order, remove_sorted)
        return scores.masked_fill(remove, float("-inf"))
