"""The speculative accept/resample rule (`stage_ar.speculative`): the token it yields has exactly the
target distribution, whatever the proposal.

* Exact: with dyadic distributions and uniforms on a grid of midpoints, enumerating every draft
  (weighted by its proposal probability) and every pair of uniforms gives the output's marginal
  exactly; it must equal the target to the last bit (float64).
* Statistical: random targets and proposals over 8 codes, 200,000 draws each (drafts drawn from the
  proposal, uniforms from a seeded generator), Pearson's chi-square at level 1e-4; the power of
  that test against a total-variation deviation of 0.005 is computed and asserted (>= 0.95).
* The rule's edge cases: all drafts accepted (bonus token from the last target), proposal equal to
  the target (nothing rejected), impossible drafts (target 0: always rejected), a window of one
  (no draft: a plain draw).
"""

from __future__ import annotations

import torch
from chi_square import p_value, power, tilt

from stage_ar.speculative import draft_positions, extend_with_eol, speculative_accept, uniform_proposal

ALPHA = 1e-4
F64 = {"dtype": torch.float64}


def midpoints(m: int) -> torch.Tensor:
    return (torch.arange(m, dtype=torch.float64) + 0.5) / m


def exact_marginal(p: torch.Tensor, q: torch.Tensor, m: int = 16) -> torch.Tensor:
    """Marginal of the token at the draft's position for one draft from ``q`` against ``p`` (V,),
    by enumeration over drafts and an ``m x m`` grid of (accept, sample) uniforms."""
    vocab = p.shape[0]
    x, ia, iu = (t.reshape(-1) for t in torch.meshgrid(torch.arange(vocab), torch.arange(m), torch.arange(m),
                                                        indexing="ij"))
    ua, us = midpoints(m)[ia], midpoints(m)[iu]
    n = x.shape[0]
    pp = torch.stack([p, torch.full_like(p, 1.0 / vocab)])[None].expand(n, -1, -1)
    accepted, token = speculative_accept(pp, q[None, None].expand(n, 1, -1), x[:, None], ua[:, None],
                                         torch.stack([us, us], dim=1))
    out = torch.where(accepted == 1, x, token)
    weight = q[x] / (m * m)
    return torch.zeros(vocab, dtype=torch.float64).index_add_(0, out, weight)


def test_exact_marginal_on_dyadic_distributions():
    cases = [
        ([0.25, 0.25, 0.25, 0.25], [0.5, 0.25, 0.125, 0.125]),
        ([0.5, 0.0, 0.25, 0.25], [0.125, 0.5, 0.125, 0.25]),  # a draft the target forbids
        ([0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.25]),  # a one-hot target (greedy, EOL)
        ([0.25, 0.125, 0.125, 0.5], [0.0, 0.0, 0.0, 1.0]),  # a one-hot proposal (spatial draft)
        ([0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]),  # proposal = target
    ]
    for p, q in cases:
        p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
        assert torch.equal(exact_marginal(p, q), p), (p, q)


def test_statistical_marginal_of_random_distributions():
    gen = torch.Generator().manual_seed(7)
    n, vocab = 200_000, 8
    for trial in range(3):
        p = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 1.5, 0)
        q = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * 1.5, 0)
        drafts = torch.multinomial(q, n, replacement=True, generator=gen)
        u = torch.rand(n, 3, generator=gen, dtype=torch.float64)
        pp = torch.stack([p, p.flip(0)])[None].expand(n, -1, -1)
        accepted, token = speculative_accept(pp, q[None, None].expand(n, 1, -1), drafts[:, None], u[:, :1], u[:, 1:])
        out = torch.where(accepted == 1, drafts, token)
        counts = torch.bincount(out, minlength=vocab)
        assert p_value(counts, p) > ALPHA, (trial, counts, p * n)
        # the rule really rejected some drafts (the test exercises the residual)
        assert 0.05 < float((accepted == 0).double().mean()) < 0.95
    assert power(p, tilt(p, 0.005), n, ALPHA, trials=500) >= 0.95


def test_two_drafts_chain_and_bonus_token():
    """A window of two drafts against a two-step Markov target: the pair of tokens at the two draft
    positions has the target's joint law (enumeration is too large: chi-square, 300,000 draws)."""
    gen = torch.Generator().manual_seed(3)
    vocab, n = 3, 300_000
    p1 = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    trans = torch.softmax(torch.randn(vocab, vocab, generator=gen, dtype=torch.float64), 1)  # p2(. | x1)
    q = torch.tensor([[0.2, 0.2, 0.6], [0.6, 0.3, 0.1]], dtype=torch.float64)
    d = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen) for i in range(2)], 1)
    p = torch.stack([p1.expand(n, -1), trans[d[:, 0]], torch.full((n, vocab), 1.0 / vocab, dtype=torch.float64)], 1)
    u = torch.rand(n, 5, generator=gen, dtype=torch.float64)
    accepted, token = speculative_accept(p, q[None].expand(n, -1, -1), d, u[:, :2], u[:, 2:])
    # position 1's token: the draft if accepted, else the resample (then position 2 is drawn afresh)
    x1 = torch.where(accepted >= 1, d[:, 0], token)
    x2_fresh = torch.multinomial(trans[x1], 1, generator=gen)[:, 0]
    x2 = torch.where(accepted == 2, d[:, 1], torch.where(accepted == 1, token, x2_fresh))
    joint = (p1[:, None] * trans).reshape(-1)
    counts = torch.bincount(x1 * vocab + x2, minlength=vocab * vocab)
    assert p_value(counts, joint) > ALPHA
    assert bool((accepted == 2).any()) and bool((accepted == 0).any())


def test_edge_cases():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]], dtype=torch.float64)
    # proposal equal to the target: always accepted, bonus from the last target
    accepted, token = speculative_accept(p, p[:, :1], torch.tensor([[1]]), torch.tensor([[0.999]], dtype=torch.float64),
                                         torch.zeros(1, 2, dtype=torch.float64))
    assert (int(accepted), int(token)) == (1, 2)
    # an impossible draft is always rejected and the resample avoids it
    accepted, token = speculative_accept(p, torch.tensor([[[1.0, 0.0, 0.0]]], dtype=torch.float64), torch.tensor([[0]]),
                                         torch.zeros(1, 1, **F64), torch.full((1, 2), 0.5, **F64))
    assert (int(accepted), int(token)) == (0, 1)
    # no drafts: a plain draw from the first target
    accepted, token = speculative_accept(p[:, 1:], p[:, :0], torch.zeros(1, 0, dtype=torch.long),
                                         torch.zeros(1, 0, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64))
    assert (int(accepted), int(token)) == (0, 2)


def test_drafts_follow_the_grid_constraint_and_token_reuse_keeps_the_law():
    vocab = 4
    eol = torch.tensor([False, True, False])
    predicted = extend_with_eol(torch.tensor([[0.5, 0.5, 0, 0], [0.25] * 4, [0, 0, 0.5, 0.5]], **F64), eol)
    assert torch.equal(predicted[1], torch.tensor([0, 0, 0, 0, 1.0], dtype=torch.float64))
    init = uniform_proposal(3, vocab)
    drafts, q = draft_positions(predicted, torch.tensor([True, True, False]), init, eol, torch.full((3,), 0.9, **F64))
    assert drafts.tolist()[1] == vocab and drafts.tolist()[2] == 3  # EOL drafted as EOL; uniform init
    assert torch.equal(q[2], init[2])
    # token reuse: the draft's law is the mixture proposal it reports (enumerate old drafts x uniforms)
    old_q = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0], dtype=torch.float64)
    new_p = torch.tensor([0.125, 0.5, 0.25, 0.125, 0.0], dtype=torch.float64)
    m = 64
    x_old = torch.arange(vocab).repeat_interleave(m)
    u = midpoints(m).repeat(vocab)
    n = x_old.shape[0]
    yes, no = torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)
    previous = (x_old, old_q.expand(n, -1), yes)
    d, mix = draft_positions(new_p.expand(n, -1), yes, uniform_proposal(n, vocab), no, u, previous)
    law = torch.zeros(vocab + 1, dtype=torch.float64).index_add_(0, d, old_q[x_old] / m)
    assert torch.equal(law, mix[0]) and torch.all(mix == mix[0])
