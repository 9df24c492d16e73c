"""`stage_ar.sampling.inverse_cdf_draw`: the first entry whose cumulative weight exceeds ``u * total``,
never an entry of weight 0 (stepping back to the last positive one), the same token for every way
of computing that rule."""

from __future__ import annotations

import pytest
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


@pytest.mark.parametrize("block", [0, 256], ids=["one-scan", "two-level"])
def test_draw_follows_the_rule_with_zeros_and_extreme_uniforms(block, monkeypatch):
    from stage_ar import sampling

    monkeypatch.setattr(sampling, "CDF_BLOCK", block)
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


@pytest.fixture
def two_level(monkeypatch):
    """`cumulative_weights` in blocks (the opt-in two-level sum)."""
    from stage_ar import sampling

    monkeypatch.setattr(sampling, "CDF_BLOCK", sampling.TWO_LEVEL_CDF_BLOCK)
    return sampling.CDF_BLOCK


def test_cumulative_weights_in_blocks_follow_the_running_sum_and_a_row_keeps_its_bits_in_any_batch(two_level):
    from stage_ar.sampling import cumulative_weights

    CDF_BLOCK = two_level
    g = torch.Generator().manual_seed(1)
    for vocab in (CDF_BLOCK - 1, CDF_BLOCK, 3 * CDF_BLOCK, 16384, 16384 + 7):
        probs = torch.rand(16, vocab, generator=g, dtype=torch.float64)
        probs[probs < 0.5] = 0.0
        cdf = cumulative_weights(probs)
        assert cdf.shape == probs.shape and cdf.is_contiguous()
        torch.testing.assert_close(cdf, probs.cumsum(-1), rtol=1e-13, atol=0)
        assert bool((cdf[:, 1:] >= cdf[:, :-1]).all())  # nondecreasing across block boundaries too
        for row in (0, 7, 15):  # alone, the same bits as inside the batch of 16
            assert torch.equal(cumulative_weights(probs[row : row + 1]), cdf[row : row + 1])


def test_a_draw_in_the_last_block_of_a_padded_row_stays_inside_the_vocabulary(two_level):
    CDF_BLOCK = two_level
    vocab = 2 * CDF_BLOCK + 3  # the last block is padded with CDF_BLOCK - 3 zeros
    probs = torch.zeros(3, vocab, dtype=torch.float64)
    probs[:, -1] = 1.0
    probs[1, 0] = 1.0
    probs[2, -3:] = 1.0
    u = torch.tensor([[0.5], [0.99], [1.0 - 2.0**-53]], dtype=torch.float64)
    got = inverse_cdf_draw(probs, u)
    assert got.tolist() == [vocab - 1, vocab - 1, vocab - 1]
    assert torch.equal(got, _rule(probs, u))
