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
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["GridConstrainedSampler", "GridSampler", "SamplingState", "T2IGenerationConfig", "inverse_cdf_draw",
           "read_t2i_generation_config"]

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
    """One request's sampling parameters and seeded generator (the sampling itself is `GridSampler`).

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
        """One token through `GridSampler` at batch size 1 (tests, tools): the token at index
        ``generated_len`` of the generated sequence from full-vocabulary ``logits (vocab,)``;
        ``previous_ids`` feed the repetition penalty. Draws one uniform from the generator unless
        greedy or at an EOL position (none then).

        Raises:
            ValueError: ``logits`` is not 1-D or too narrow for the visual range.
        """
        if logits.dim() != 1:
            raise ValueError(f"logits must be 1-D (vocab,), got shape {tuple(logits.shape)}")
        if logits.shape[0] < self.visual_token_end_id:
            raise ValueError(f"logits width {logits.shape[0]} < visual_token_end_id {self.visual_token_end_id}")
        sampler = GridSampler(self.eol_token_id, self.visual_token_start_id, self.visual_token_end_id, logits.device)
        draw = not self.greedy and not self.is_eol_position(generated_len)
        uniforms = torch.rand(1, generator=self.generator, dtype=torch.float64) if draw else torch.zeros(1)
        state = SamplingState.for_request(self, sampler.vocab, 1, 0.0, previous_ids or [], uniforms, logits.device)
        state.sample_idx.fill_(generated_len)
        state.uniforms_base = generated_len
        return int(sampler(logits[None, self.visual_token_start_id : self.visual_token_end_id].float(), state)[0])


@dataclass
class SamplingState:
    """Per-row sampling state of ``n`` rows on one device (a request's rows, or the runner's slots).

    Row ``i`` samples with its own parameters; with AR-side CFG the conditional row has
    ``has_partner`` and ``partner`` = its unconditional row, and every row takes the token of its
    ``source`` row. ``uniforms[i, j - uniforms_base]`` is the uniform of sample ``j``; ``seen`` marks
    visual codes for the repetition penalty. Integer tensors int64, scales float32.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p_cut: torch.Tensor  # 1 - top_p, computed in float64 on the host as upstream
    use_top_p: torch.Tensor
    penalty: torch.Tensor
    cfg_scale: torch.Tensor
    partner: torch.Tensor
    has_partner: torch.Tensor
    source: torch.Tensor
    greedy: torch.Tensor
    width: torch.Tensor
    sample_idx: torch.Tensor
    uniforms: torch.Tensor
    seen: torch.Tensor
    uniforms_base: int = 0

    @classmethod
    def allocate(cls, n: int, vocab: int, samples: int, device: torch.device | str | None) -> SamplingState:
        """``n`` idle rows (each its own source) with room for ``samples`` uniforms per row."""
        i64 = {"device": device, "dtype": torch.long}
        f32 = {"device": device, "dtype": torch.float32}
        b = {"device": device, "dtype": torch.bool}
        return cls(
            temperature=torch.ones(n, **f32), top_k=torch.full((n,), vocab, **i64), top_p_cut=torch.zeros(n, **f32),
            use_top_p=torch.zeros(n, **b), penalty=torch.ones(n, **f32), cfg_scale=torch.ones(n, **f32),
            partner=torch.arange(n, **i64), has_partner=torch.zeros(n, **b), source=torch.arange(n, **i64),
            greedy=torch.zeros(n, **b), width=torch.ones(n, **i64), sample_idx=torch.zeros(n, **i64),
            uniforms=torch.zeros(n, samples, device=device, dtype=torch.float64), seen=torch.zeros(n, vocab, **b),
        )

    @classmethod
    def for_request(
        cls, params: GridConstrainedSampler, vocab: int, rows: int, cfg_scale: float, seen_ids: list[int],
        uniforms: torch.Tensor, device: torch.device | str | None,
    ) -> SamplingState:
        """One request's ``rows`` (2 with AR-side CFG: conditional, unconditional); ``uniforms`` the
        request's uniform table (CPU float64), ``seen_ids`` the ids the repetition penalty starts from."""
        state = cls.allocate(rows, vocab, uniforms.shape[0], device)
        k = vocab if params.top_k is None else min(max(params.top_k, MIN_TOKENS_TO_KEEP), vocab)
        state.temperature.fill_(params.temperature if not params.greedy else 1.0)
        state.top_k.fill_(k)
        state.top_p_cut.fill_(1.0 - params.top_p)
        state.use_top_p.fill_(params.top_p < 1.0)
        state.penalty.fill_(params.repetition_penalty)
        state.cfg_scale.fill_(cfg_scale)
        state.greedy.fill_(params.greedy)
        state.width.fill_(params.ar_width)
        state.uniforms.copy_(uniforms.to(torch.float64).expand(rows, -1))
        if rows == 2:
            state.partner[0], state.has_partner[0], state.source[1] = 1, True, 0
        if params.repetition_penalty != 1.0 and seen_ids:
            ids = torch.tensor(seen_ids, dtype=torch.long) - params.visual_token_start_id
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[ids[(ids >= 0) & (ids < vocab)]] = True
            state.seen.copy_(mask.to(state.seen.device).expand(rows, -1))
        return state

    @property
    def needs_sort(self) -> bool:
        """Any row uses top-k or top-p (host sync; call at joins, not per step)."""
        return bool(((self.top_k < self.seen.shape[1]) | self.use_top_p).any())

    def copy_into(self, other: SamplingState, first: int) -> None:
        """Write these rows into ``other``'s rows ``[first, first + n)`` (indices shifted)."""
        n = self.temperature.shape[0]
        span = slice(first, first + n)
        for f in dataclasses.fields(self):
            if f.name in ("uniforms", "uniforms_base"):
                continue
            src = getattr(self, f.name)
            if f.name in ("partner", "source"):
                src = src + first
            getattr(other, f.name)[span] = src.to(getattr(other, f.name).device)
        other.uniforms[span].zero_()
        other.uniforms[span, : self.uniforms.shape[1]] = self.uniforms.to(other.uniforms.device)

    def clear(self, first: int, count: int) -> None:
        """Rows ``[first, first + count)`` back to idle (own source, no partner)."""
        span = slice(first, first + count)
        rows = torch.arange(first, first + count, device=self.partner.device)
        self.has_partner[span] = False
        self.partner[span] = rows
        self.source[span] = rows


class GridSampler(nn.Module):
    """The one grid sampler: batched, on the logits' device, no host sync (CUDA-graph capturable).

    Steps, per row (upstream ``generate_t2i`` order): AR-CFG mix with the partner row, repetition
    penalty over ``seen``, temperature, top-k, top-p (both keep at least `MIN_TOKENS_TO_KEEP`),
    float64 softmax, inverse-CDF draw with the row's uniform for its sample index (argmax when
    greedy), then the grid constraint: EOL where ``sample_idx % (width + 1) == width``; every row
    returns its ``source`` row's token.

    Args:
        eol_token_id, visual_token_start_id, visual_token_end_id: the grid vocabulary; logits are
            the visual slice ``[start, end)`` only.
        device: where the logits live (its index table is built there once).
    """

    def __init__(self, eol_token_id: int, visual_token_start_id: int, visual_token_end_id: int,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eol = int(eol_token_id)
        self.vstart, self.vend = int(visual_token_start_id), int(visual_token_end_id)
        self.vocab = self.vend - self.vstart
        self.register_buffer("vocab_index", torch.arange(self.vocab, device=device), persistent=False)

    def mark_seen(self, state: SamplingState, fed: torch.Tensor, active: torch.Tensor) -> None:
        """Record the fed tokens ``(b,)`` of ``active (b,)`` rows for the repetition penalty; ``fed``
        may be ``(b, n)``: ``n`` tokens per row (a Jacobi window's final tokens)."""
        b = fed.shape[0]
        vis = fed - self.vstart
        if fed.dim() == 2:  # scatter only True values (duplicates are harmless), non-codes to a spare column
            hit = active[:, None] & (vis >= 0) & (vis < self.vocab)
            marks = torch.zeros(b, self.vocab + 1, dtype=torch.bool, device=fed.device)
            marks.scatter_(1, torch.where(hit, vis, self.vocab), True)
            state.seen[:b] |= marks[:, : self.vocab]
            return
        in_vis = active & (vis >= 0) & (vis < self.vocab)
        rows = torch.arange(b, device=fed.device)
        idx = vis.clamp(0, self.vocab - 1)
        state.seen[rows, idx] = state.seen[rows, idx] | in_vis

    def forward(self, logits: torch.Tensor, state: SamplingState, sort: bool = True) -> torch.Tensor:
        """``logits (b, vocab)`` float32 of the visual slice -> token ids ``(b,)`` int64.

        ``sort=False`` skips top-k/top-p (valid only when no row uses them: same tokens then)."""
        b = logits.shape[0]
        scores, greedy_idx = self._scores(logits, state, sort)
        index = self._draw(scores, state, b)
        index = torch.where(state.greedy[:b], greedy_idx, index)
        width, sidx = state.width[:b], state.sample_idx[:b]
        tokens = torch.where(sidx % (width + 1) == width, torch.full_like(index, self.eol), index + self.vstart)
        return tokens[state.source[:b]]

    def probabilities(self, logits: torch.Tensor, state: SamplingState, sort: bool = True) -> torch.Tensor:
        """The distribution `forward` draws each row's visual code from: ``logits (b, vocab)`` float32
        -> ``(b, vocab)`` float64 (a one-hot at the argmax for greedy rows). The grid constraint is
        not applied (at EOL positions `forward` returns EOL whatever this says)."""
        b = logits.shape[0]
        scores, greedy_idx = self._scores(logits, state, sort)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float64)
        greedy = torch.nn.functional.one_hot(greedy_idx, self.vocab).to(torch.float64)
        return torch.where(state.greedy[:b, None], greedy, probs)

    def _scores(self, logits: torch.Tensor, state: SamplingState, sort: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """CFG mix, repetition penalty, temperature, top-k/top-p: ``(scores (b, vocab), greedy index (b,))``."""
        b = logits.shape[0]
        scores = self._cfg_mix(logits, state, b)
        scores = self._repetition_penalty(scores, state, b)
        greedy_idx = torch.argmax(scores, dim=-1)
        scores = scores / state.temperature[:b, None]
        if sort:
            scores = self._top_k_top_p(scores, state, b)
        return scores, greedy_idx

    @staticmethod
    def _cfg_mix(logits: torch.Tensor, state: SamplingState, b: int) -> torch.Tensor:
        uncond = logits[state.partner[:b]]
        mixed = uncond + (logits - uncond) * state.cfg_scale[:b, None]
        return torch.where(state.has_partner[:b, None], mixed, logits)

    @staticmethod
    def _repetition_penalty(scores: torch.Tensor, state: SamplingState, b: int) -> torch.Tensor:
        p = state.penalty[:b, None]
        penalised = torch.where(scores < 0, scores * p, scores / p)
        return torch.where(state.seen[:b] & (p != 1.0), penalised, scores)

    def _top_k_top_p(self, s: torch.Tensor, state: SamplingState, b: int) -> torch.Tensor:
        desc = torch.sort(s, dim=-1, descending=True).values
        kth = desc.gather(1, (state.top_k[:b] - 1)[:, None])
        s = s.masked_fill(s < kth, float("-inf"))
        asc, order = torch.sort(s, dim=-1, descending=False)
        cumulative = torch.softmax(asc, dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= state.top_p_cut[:b, None]
        keep_tail = self.vocab_index >= self.vocab - MIN_TOKENS_TO_KEEP
        remove_sorted = remove_sorted & ~keep_tail[None, :] & state.use_top_p[:b, None]
        remove = remove_sorted.scatter(1, order, remove_sorted)
        return s.masked_fill(remove, float("-inf"))

    def _draw(self, s: torch.Tensor, state: SamplingState, b: int) -> torch.Tensor:
        probs = torch.softmax(s, dim=-1, dtype=torch.float64)
        col = (state.sample_idx[:b] - state.uniforms_base).clamp(0, state.uniforms.shape[1] - 1)
        return inverse_cdf_draw(probs, state.uniforms[:b].gather(1, col[:, None]), self.vocab_index)


def inverse_cdf_draw(probs: torch.Tensor, u: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse-CDF draw per row: ``probs (b, V)`` nonnegative float64 weights (need not sum to 1),
    ``u (b, 1)`` uniforms in ``[0, 1)`` -> ``(b,)`` int64, the first entry whose cumulative weight
    exceeds ``u * total``; never an entry of weight 0. ``index`` is ``arange(V)`` on the device
    (built when None). Capturable: no host sync."""
    vocab = probs.shape[-1]
    if index is None:
        index = torch.arange(vocab, device=probs.device)
    cdf = torch.cumsum(probs, dim=-1)
    u = u * cdf[:, -1:]
    pick = torch.searchsorted(cdf, u, right=True).clamp(max=vocab - 1)
    # never land on a zero-probability entry: step back to the last positive one at or before the
    # pick (one masked max, not a cummax: that scan-with-indices kernel cost ~45 us per step on the H200)
    keep = (probs > 0) & (index[None, :] <= pick)
    return torch.where(keep, index[None, :], 0).amax(dim=-1)
