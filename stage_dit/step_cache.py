"""Opt-in step caching for the DiT: a first-block residual cache (in the style of Cache-DiT's
"DBCache F1B0" and ParaAttention's first-block cache; TeaCache uses the same signal at the input).

At every step the first joint layer runs as usual. Its residual (output - input over the request's
real rows) is compared with the residual of the last step that ran every layer:
``change = mean|r_t - r_last| / mean|r_last|``. After ``warmup_steps`` steps, a step whose change
(the larger of the two CFG branches) is below ``threshold`` skips the remaining joint layers and adds
the remainder residual cached at that last full step (``h_last_layer - h_first_layer``) to the first
layer's output instead. Off by default; off means no code of this module runs. Quality on real
weights is the user's to judge: the deviation this introduces is measured on the random tiny model
only (`tests/unit/test_dit_step_cache.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StepCacheConfig:
    """Per-request step cache settings (the API's ``dit_cache``).

    Attributes:
        threshold: relative change of the first layer's residual below which a step reuses the
            cached remainder; 0 = off.
        warmup_steps: the first steps always run every layer (and fill the cache).

    Raises:
        ValueError: a negative or non-finite threshold, or negative warm-up.
    """

    threshold: float = 0.0
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.threshold) < float("inf"):
            raise ValueError(f"dit_cache.threshold must be >= 0 and finite, got {self.threshold}")
        if int(self.warmup_steps) != self.warmup_steps or self.warmup_steps < 0:
            raise ValueError(f"dit_cache.warmup_steps must be a non-negative integer, got {self.warmup_steps}")

    @property
    def enabled(self) -> bool:
        return self.threshold > 0.0


@dataclass
class FirstBlockCache:
    """One request's cache state, keyed by CFG branch (0 = condition, 1 = unconditional).

    Attributes:
        config: the request's `StepCacheConfig`.
        first: first-layer residual `(real_rows, hidden)` of the last full step, per branch.
        rest: remainder residual `(real_rows, hidden)` of the last full step, per branch.
        skipped: steps that reused the remainder.
    """

    config: StepCacheConfig
    first: dict[int, torch.Tensor] = field(default_factory=dict)
    rest: dict[int, torch.Tensor] = field(default_factory=dict)
    skipped: int = 0

    def should_skip(self, step: int, residuals: dict[int, torch.Tensor]) -> bool:
        """Whether step ``step`` (0-based) may reuse the remainder, given this step's first-layer
        residual per branch (`(real_rows, hidden)` each)."""
        if step < self.config.warmup_steps or any(b not in self.rest for b in residuals):
            return False
        change = max(_relative_l1(r, self.first[b]) for b, r in residuals.items())
        return change < self.config.threshold

    def update(self, residuals: dict[int, torch.Tensor], rests: dict[int, torch.Tensor]) -> None:
        """Record a full step: its first-layer and remainder residuals per branch."""
        self.first.update(residuals)
        self.rest.update(rests)


def _relative_l1(now: torch.Tensor, before: torch.Tensor) -> float:
    if now.shape != before.shape:
        return float("inf")
    denominator = before.float().abs().mean()
    return float((now.float() - before.float()).abs().mean() / denominator.clamp_min(1e-12))
