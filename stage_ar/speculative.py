"""Speculative sampling arithmetic for Jacobi windows: the accept/resample rule and the drafts.

Pure, batched torch functions (no model, no engine); `stage_ar.jacobi` runs them over the model's
window forwards. Distributions are float64 over an *extended* grid vocabulary of ``V + 1`` entries:
the ``V`` visual codes (index ``i`` is token ``visual_token_start_id + i``) and, at index ``V``, the
end-of-line token. At an EOL position of the grid the target and every proposal are the one-hot of
index ``V`` (the grid constraint, applied to drafts and verification alike: such a draft is always
accepted); elsewhere index ``V`` has probability 0.

The rule (Leviathan et al. 2023, Chen et al. 2023; SJD, Teng et al. 2024, for Jacobi windows): a
draft ``x`` drawn from a proposal ``q`` is accepted when ``u * q(x) < p(x)`` for a uniform ``u`` in
``[0, 1)``, i.e. with probability ``min(1, p(x) / q(x))``; the first rejected position takes a sample
of ``norm(max(0, p - q))``. Then the token at that position has exactly the distribution ``p``
whatever ``q`` is, provided ``x`` was drawn from ``q`` independently of the uniforms and ``q`` was
fixed before the draw (``tests/unit/test_speculative.py`` checks this exactly and statistically).
"""

from __future__ import annotations

import torch

from stage_ar.sampling import inverse_cdf_draw

__all__ = ["draft_positions", "extend_with_eol", "speculative_accept", "uniform_proposal"]


def speculative_accept(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor, u_sample: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``D`` drafts per row and draw the token after the accepted ones.

    Args:
        p: ``(N, D + 1, V)`` float64 target distributions: ``p[:, i]`` at draft ``i``'s position
            given everything before it, ``p[:, D]`` at the position after the last draft.
        q: ``(N, D, V)`` float64 proposals the drafts were drawn from.
        drafts: ``(N, D)`` int64 indices into ``V``.
        u_accept: ``(N, D)`` float64 uniforms in ``[0, 1)``, one per draft.
        u_sample: ``(N, D + 1)`` float64 uniforms in ``[0, 1)``, one per position that may be sampled.

    Returns:
        ``(accepted (N,), token (N,))`` int64: drafts ``0 .. accepted - 1`` are accepted (the first
        rejection ends the run); ``token`` is the sample at position ``accepted``, from
        ``norm(max(0, p - q))`` there when a draft was rejected (from ``p`` should that be all zero,
        which happens only with probability 0), or from ``p[:, D]`` when all were accepted.

    Raises:
        ValueError: shapes that do not match.
    """
    n, d1, vocab = p.shape
    d = d1 - 1
    if tuple(q.shape) != (n, d, vocab) or tuple(drafts.shape) != (n, d) or tuple(u_accept.shape) != (n, d):
        raise ValueError(f"p {tuple(p.shape)}, q {tuple(q.shape)}, drafts {tuple(drafts.shape)}, "
                         f"u_accept {tuple(u_accept.shape)} do not match")
    if tuple(u_sample.shape) != (n, d1):
        raise ValueError(f"u_sample must be {(n, d1)}, got {tuple(u_sample.shape)}")
    rows = torch.arange(n, device=p.device)
    if d:
        index = drafts[..., None]
        ok = u_accept * q.gather(2, index)[..., 0] < p[:, :d].gather(2, index)[..., 0]
        accepted = torch.cumprod(ok.long(), dim=1).sum(dim=1)
    else:
        accepted = torch.zeros(n, dtype=torch.long, device=p.device)
    p_at = p[rows, accepted]
    q_at = torch.cat([q, q.new_zeros(n, 1, vocab)], dim=1)[rows, accepted]
    residual = (p_at - q_at).clamp_min(0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    token = inverse_cdf_draw(residual, u_sample.gather(1, accepted[:, None]))
    return accepted, token


def extend_with_eol(probs: torch.Tensor, eol_position: torch.Tensor) -> torch.Tensor:
    """``probs (n, V)`` over visual codes -> ``(n, V + 1)``: EOL (index ``V``) weight 0, except rows
    where ``eol_position (n,)`` bool is set, which become the one-hot of EOL."""
    n, vocab = probs.shape
    out = torch.cat([probs, probs.new_zeros(n, 1)], dim=1)
    eol = torch.zeros_like(out)
    eol[:, vocab] = 1.0
    return torch.where(eol_position[:, None], eol, out)


def uniform_proposal(n: int, vocab: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``(n, vocab + 1)`` float64: uniform over the ``vocab`` visual codes, EOL weight 0 (SJD's
    random initialisation of new draft positions)."""
    q = torch.full((n, vocab + 1), 1.0 / vocab, dtype=torch.float64, device=device)
    q[:, vocab] = 0.0
    return q


def draft_positions(
    predicted: torch.Tensor,
    has_prediction: torch.Tensor,
    init: torch.Tensor,
    eol_position: torch.Tensor,
    u: torch.Tensor,
    previous: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft ``m`` future positions and return ``(drafts (m,) int64, proposals (m, V + 1) float64)``.

    A position with a prediction (``has_prediction``) is drafted from ``predicted`` (the Jacobi
    step: the last forward's distribution there, given the tokens that forward was fed); one
    without, from ``init`` (uniform, or a one-hot of the token one grid row above: SJD++'s spatial
    initialisation). EOL positions draft EOL (one-hot of index ``V``).

    With ``previous = (old_drafts (m,), old_q (m, V + 1), has_old (m,) bool)`` (SJD++ token reuse),
    a predicted position keeps its old draft ``x`` when ``predicted(x) >= old_q(x)`` and otherwise
    draws from ``predicted``; its proposal is then the mixture ``old_q * c + (1 - sum(old_q * c)) *
    predicted`` with ``c = [predicted >= old_q]``, which is exactly the law of that choice, so the
    accept rule stays exact.

    Args:
        predicted, init: ``(m, V + 1)`` float64 distributions.
        has_prediction, eol_position: ``(m,)`` bool.
        u: ``(m,)`` float64 uniforms in ``[0, 1)`` for the draws.
    """
    proposal = torch.where(has_prediction[:, None], predicted, init)
    drafts = inverse_cdf_draw(proposal, u[:, None])
    if previous is not None:
        old, old_q, has_old = previous
        keep_set = predicted >= old_q
        kept_mass = (old_q * keep_set).sum(-1, keepdim=True)
        mixture = old_q * keep_set + (1.0 - kept_mass).clamp_min(0.0) * predicted
        reuse = has_old & has_prediction
        keep = reuse & keep_set.gather(1, old[:, None])[:, 0]
        drafts = torch.where(keep, old, drafts)
        proposal = torch.where(reuse[:, None], mixture, proposal)
    vocab = proposal.shape[1] - 1
    eol = torch.zeros_like(proposal)
    eol[:, vocab] = 1.0
    proposal = torch.where(eol_position[:, None], eol, proposal)
    drafts = torch.where(eol_position, torch.full_like(drafts, vocab), drafts)
    return drafts, proposal
