"""`stage_ar.sampling.inverse_cdf_draw`: the first entry whose cumulative weight exceeds ``u * total``,
never an entry of weight 0 (stepping back to the last positive one), the same token for every way
of computing that rule."""

from __future__ import annotations

import torch

from stage_ar.sampling import inverse_cdf_draw


def _rule(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The rule written plainly, one row at a time in Python."""
    out = []
    for p, x in zip(probs.tolist(), u[:, 0].tolist()):
        cdf, total = [], 0.0
        for v in p:
            total += v
            cdf.append(total)
        target = x * cdf[-1]
        pick = next((i for i, c in enumerate(cdf) if c > target), len(p) - 1)
        while pick > 0 and p[pick] <= 0:
            pick -= 1
        out.append(pick)
    return torch.tensor(out)


def test_draw_follows_the_rule_with_zeros_and_extreme_uniforms():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(64, 300, generator=g, dtype=torch.float64)
    probs[probs < 0.7] = 0.0  # most entries zero, runs of zeros everywhere
    probs[:8, -40:] = 0.0  # zero tails: a draw near u = 1 must step back
    probs[8, :] = 0.0
    probs[8, 5] = 1.0  # one positive entry
    u = torch.rand(64, 1, generator=g, dtype=torch.float64)
    u[:8] = 1.0 - 2.0**-53  # u * total can round up to the total: pick clamps to the last entry
    u[9] = 0.0
    got = inverse_cdf_draw(probs, u)
    assert torch.equal(got, _rule(probs, u))
    assert bool((probs.gather(1, got[:, None]) > 0).all())
