"""Pearson's chi-square goodness-of-fit test and its power, in torch (no scipy here).

`p_value(counts, probs)`: counts of ``n`` draws over cells vs the exact cell probabilities (cells of
probability 0 must have count 0, checked). `power(probs, alt, n, alpha)`: the fraction of simulated
experiments of ``n`` draws from the alternative ``alt`` that the test rejects at level ``alpha`` (the
tests state the power against a named deviation, and assert it).
"""

from __future__ import annotations

import torch


def statistic(counts: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(chi-square statistic, degrees of freedom)`` over the cells of positive probability;
    ``counts`` may be batched ``(..., cells)``."""
    counts = counts.double()
    probs = probs.double()
    support = probs > 0
    if bool((counts[..., ~support] > 0).any()):
        raise AssertionError("a cell of probability 0 was drawn")
    n = counts.sum(-1, keepdim=True)
    expected = n * probs[support]
    stat = ((counts[..., support] - expected) ** 2 / expected).sum(-1)
    return stat, int(support.sum()) - 1


def p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper-tail chi-square p-value of ``counts (cells,)`` against ``probs (cells,)``."""
    stat, df = statistic(counts, probs)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def power(probs: torch.Tensor, alt: torch.Tensor, n: int, alpha: float, trials: int = 2000, seed: int = 0) -> float:
    """Fraction of ``trials`` experiments of ``n`` draws from ``alt`` whose p-value against ``probs``
    is below ``alpha``."""
    gen = torch.Generator().manual_seed(seed)
    alt = alt.double()
    counts = torch.zeros(trials, probs.shape[0], dtype=torch.float64)
    remaining = torch.full((trials,), float(n), dtype=torch.float64)
    rest = 1.0
    for i in range(probs.shape[0]):  # multinomial counts as a chain of binomials
        share = min(1.0, float(alt[i]) / rest) if rest > 0 else 0.0
        counts[:, i] = torch.binomial(remaining, torch.full_like(remaining, share), generator=gen)
        remaining -= counts[:, i]
        rest -= float(alt[i])
    keep = probs > 0
    counts = counts[:, keep]
    stat, df = statistic(counts, probs[keep])
    pv = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2)
    return float((pv < alpha).double().mean())


def tilt(probs: torch.Tensor, tv: float) -> torch.Tensor:
    """``probs`` with total-variation distance ``tv`` moved from its largest cell to its smallest positive one."""
    alt = probs.double().clone()
    pos = torch.nonzero(alt > 0)[:, 0]
    hi = pos[alt[pos].argmax()]
    lo = pos[alt[pos].argmin()]
    alt[hi] -= tv
    alt[lo] += tv
    return alt
