"""Speculative Jacobi decoding in the batched engine: every ``jacobi`` sequence carries a window.

Batch invariance: with the runner's ``pad_to_max_bucket`` (the engine's ``batch_invariant``, the
default) or ``exact_rows`` every window runs its own forward over the whole pool width, so its
shapes, and therefore its bits, never depend on what else is decoding; without it, one forward
covers every window of the same length (fewer launches, rows then depend on the batch).

`JacobiVerifier` belongs to an `stage_ar.runner.ARModelRunner` (same model, KV pool and
`GridSampler`); the runner hands it the sequences whose `DecodingOptions` say ``jacobi`` and steps
them in `JacobiVerifier.step`, after its own sequential step, each engine turn. One turn, for the
windows of ``T`` tokens (grouped by ``T``, which differs only in a grid's last window):

1. one forward over the windows (see above): row ``r`` feeds ``[t0, d1 .. d(T-1)]`` at cache positions
   ``P + g .. P + g + T - 1`` (``t0`` the next token, exactly sampled; ``d`` the drafts), causal
   inside the window (`stage_ar.window_forward.WindowForward`: the split-KV Triton kernel's window
   variant on CUDA, replayed as one CUDA graph per window shape; or with ``exact_rows`` each
   sequence's own SDPA forward over its `KVCache` view: the B=1 path's call with ``T`` tokens);
2. the sampler's distributions at every window position (`GridSampler.probabilities`: AR-CFG mix,
   repetition penalty over the prefix *including the drafts before it*, temperature, top-k/top-p),
   extended by the grid constraint (`stage_ar.speculative.extend_with_eol`);
3. `stage_ar.speculative.speculative_accept` with the request's seeded uniforms: ``k`` drafts
   accepted, the next token drawn;
4. the ``k + 1`` fed tokens ``t0, d1 .. dk`` are final: their rows come from this forward, whose
   whole prefix for each of them was accepted (exactly the rows a sequential decode computes, up to
   the floating-point order of a ``T``-query forward); the rest of the window's keys/values are
   stale and the next window, which starts at ``P + g + k + 1``, overwrites them before reading;
5. new drafts (`stage_ar.speculative.draft_positions`): from this forward's predictions where it
   made one, else uniform (SJD) or the token one grid row above (SJD++ ``spatial_init``).

Randomness: per window, ``3 * window`` float64 uniforms from the request's CPU generator (the one
that seeded its sampler; drawn after the prefill's table), so a seed gives the same grid on every
run and whatever else is in the batch. Costs: one host read-back per window forward (accepted
counts, next tokens and the fed ids, one small copy); everything else (window ids, targets, the
accept rule, new drafts) stays on the device, and host-to-device copies are asynchronous.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from stage_ar.generation import T2ISequence
from stage_ar.modeling_mammoth_ar import build_key_mask
from stage_ar.sampling import SamplingState
from stage_ar.speculative import draft_positions, extend_with_eol, speculative_accept, uniform_proposal
from stage_ar.window_forward import WindowForward

__all__ = ["JacobiVerifier", "WindowResult"]


@dataclasses.dataclass
class WindowResult:
    """One sequence's outcome of a Jacobi turn.

    Attributes:
        key: the caller's handle (`ARModelRunner.activate`).
        slot: the sequence's first pool slot.
        fed: the grid tokens now final, in order (``k + 1`` of them).
        hidden: ``(k + 1, H)`` their rows (model dtype and device).
        next_token: the token sampled after them (the look-ahead when ``finished``).
        finished: every grid token is final; the sequence left the verifier.
        drafts_accepted: ``k``.
    """

    key: Any
    slot: int
    fed: list[int]
    hidden: torch.Tensor
    next_token: int
    finished: bool
    drafts_accepted: int


@dataclasses.dataclass(eq=False)
class _Window:
    key: Any
    seq: T2ISequence
    first: int
    count: int
    fed: int  # grid tokens final so far (g)
    next_token: int  # token id of t0
    drafts: torch.Tensor  # (D,) extended indices
    q: torch.Tensor  # (D, V + 1) their proposals
    needs_sort: bool
    ids: torch.Tensor | None = None  # (D + 1,) on the device: the next window's ids [t0, d1 .. dD]
    grid: torch.Tensor | None = None  # (grid tokens + 1,) on the device: final grid ids, then t0 (EOL beyond)

    @property
    def remaining(self) -> int:
        return self.seq.grid_tokens - self.fed


class JacobiVerifier:
    """The Jacobi windows of one runner (see module doc). ``runner`` is the owning
    `ARModelRunner` (its model, pool, sampler, grid ids, ``exact_rows``, ``cache_pos``)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._windows: dict[int, _Window] = {}  # by first slot
        self.window_forward = WindowForward(runner.model, runner.pool.key, runner.pool.value, runner.vstart,
                                            runner.vend, runner.scale, fused_attention=runner.fused_attention,
                                            cuda_graphs=runner.cuda_graphs)
        self.forwards = 0
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._windows)

    def __contains__(self, first: int) -> bool:
        return first in self._windows

    def activate(self, key: Any, seq: T2ISequence, first: int) -> None:
        """Take a prefilled ``jacobi`` sequence at pool slot ``first`` (its first window drafted now)."""
        r = self.runner
        win = _Window(key, seq, first, seq.cache_batch, len(seq.generated_ids), int(seq.next_token),
                      torch.empty(0, dtype=torch.long, device=r.device),
                      torch.empty(0, r.vocab + 1, dtype=torch.float64, device=r.device),
                      seq.sampling_state.needs_sort)
        u = self._uniforms(win)
        index = r.vocab if win.next_token == r.eol else win.next_token - r.vstart  # as an extended index
        known = seq.generated_ids + [win.next_token]
        host = torch.tensor([index] + known + [r.eol] * (seq.grid_tokens + 1 - len(known)), dtype=torch.long)
        host = host.to(r.device, non_blocking=True)
        token, win.grid = host[:1], host[1:]
        self._redraft(win, None, -1, 0, u[2 * self._window(win):], token)
        self._windows[first] = win
        self._park(win)

    def deactivate(self, first: int, key: Any = None) -> Any:
        """Drop the window at ``first`` (finished or cancelled); returns its key (None: not held, or
        held by another ``key``)."""
        win = self._windows.get(first)
        if win is None or (key is not None and win.key is not key):
            return None
        del self._windows[first]
        return win.key

    @torch.inference_mode()
    def step(self) -> list[WindowResult]:
        """One verification forward per window length over every window; returns each outcome."""
        groups: dict[tuple[int, int], list[_Window]] = {}
        alone = self.runner.pad_to_max_bucket  # batch invariance: each window its own forward
        for first in sorted(self._windows):
            win = self._windows[first]
            t = min(self._window(win), win.remaining)
            groups.setdefault((t, first if alone else 0), []).append(win)
        results = []
        for (t, _), wins in sorted(groups.items()):
            hidden, logits = self._forward(wins, t)
            self.forwards += 1
            results.extend(self._verify(wins, t, hidden, logits))
        return results

    # ---- internals ------------------------------------------------------------------------------

    @staticmethod
    def _window(win: _Window) -> int:
        return win.seq.decoding.window

    def _uniforms(self, win: _Window) -> torch.Tensor:
        """This turn's ``3 * window`` uniforms of the request: accept, sample, draft."""
        u = torch.rand(3 * self._window(win), generator=win.seq.sampler.generator, dtype=torch.float64)
        return u.to(self.runner.device, non_blocking=True)

    def _park(self, win: _Window) -> None:
        """Point the runner's per-slot cache index at the window's start: a sequential step writes
        its (discarded) keys for an idle slot there, which the next window overwrites first."""
        pos = win.seq.prompt_len + win.fed
        self.runner.cache_pos[win.first : win.first + win.count] = pos

    def _forward(self, wins: list[_Window], t: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per window, ``(hidden (count, t, H), logits (count * t, V))`` of one forward."""
        r = self.runner
        if not r.exact_rows:
            return self._forward_batched(wins, t)
        outs = [self._forward_exact(win, win.ids[:t].tolist(), t) for win in wins]
        logits = [r.model.compute_logits(h.reshape(-1, h.shape[-1]), r.vstart, r.vend) for h in outs]
        return outs, logits

    def _forward_exact(self, win: _Window, row_ids: list[int], t: int) -> torch.Tensor:
        r, seq = self.runner, win.seq
        start = seq.prompt_len + win.fed
        cache = r.pool.view(win.first, win.count)
        cache.length = start
        ids = torch.tensor([row_ids] * win.count, dtype=torch.long, device=r.device)
        positions = torch.tensor([[start + off + j for j in range(t)] for off in seq.position_offsets],
                                 dtype=torch.long, device=r.device)
        mask = build_key_mask(seq.key_starts, start + t, r.device) if seq.cfg else None
        out = r.model(ids, positions, kv_cache=cache, attention_mask=mask, compute_logits=False)
        return out.last_hidden_state

    def _forward_batched(self, wins: list[_Window], t: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        r = self.runner
        meta: list[list[int]] = [[], [], [], []]  # slot, cache position, RoPE position, first key
        for win in wins:
            start = win.seq.prompt_len + win.fed
            for row in range(win.count):
                for column, value in zip(meta, (win.first + row, start, start + win.seq.position_offsets[row],
                                                win.seq.key_starts[row])):
                    column.append(value)
        if r.pad_to_max_bucket:
            length = r.capacity
        else:
            length = next((n for n in r.length_buckets if n >= max(meta[1]) + t), r.capacity)
        ids = torch.cat([win.ids[None, :t].expand(win.count, t) for win in wins])
        full = all(self._window(win) == t for win in wins)
        hidden, logits = self.window_forward(meta, ids, length, capture=full)
        counts = [win.count for win in wins]
        return list(hidden.split(counts)), list(logits.split([c * t for c in counts]))

    def _targets(self, win: _Window, t: int, logits: torch.Tensor, fed_ids: torch.Tensor) -> torch.Tensor:
        """``(t, V + 1)`` targets at the window's outputs (output ``j`` predicts grid index ``g + j + 1``)."""
        r, seq = self.runner, win.seq
        state = expand_state(seq.sampling_state, t, win.fed + 1, fed_ids, r.vstart)
        probs = r.sampler.probabilities(logits, state, win.needs_sort)[:t]  # the conditional row
        index = win.fed + 1 + torch.arange(t, device=r.device)
        return extend_with_eol(probs, index % (seq.ar_width + 1) == seq.ar_width)

    def _verify(self, wins: list[_Window], t: int, hidden: list[torch.Tensor],
                logits: list[torch.Tensor]) -> list[WindowResult]:
        r = self.runner
        d = t - 1
        fed_ids = torch.stack([win.ids[:t] for win in wins])  # (N, t) on the device
        p = torch.stack([self._targets(win, t, lg, ids) for win, lg, ids in zip(wins, logits, fed_ids)])
        uniforms = [self._uniforms(win) for win in wins]
        q = torch.stack([win.q[:d] for win in wins])
        drafts = torch.stack([win.drafts[:d] for win in wins])
        w = [self._window(win) for win in wins]
        u_acc = torch.stack([u[:d] for u in uniforms])
        u_smp = torch.stack([u[wi : wi + t] for u, wi in zip(uniforms, w)])
        accepted, token = speculative_accept(p, q, drafts, u_acc, u_smp)
        for i, win in enumerate(wins):  # on the device, before the read-back: overlaps the forward
            self._advance(win, fed_ids[i], accepted[i], token[i : i + 1])
            self._redraft(win, p[i], accepted[i], t, uniforms[i][2 * w[i]:], token[i : i + 1])
        n = len(wins)
        host = torch.cat([accepted, token, fed_ids.reshape(-1)]).tolist()  # the turn's one read-back
        results = []
        for i, win in enumerate(wins):
            k, nxt = host[i], host[n + i]
            fed = host[2 * n + i * t : 2 * n + i * t + k + 1]
            win.fed += k + 1
            win.next_token = next_id = r.eol if nxt == r.vocab else nxt + r.vstart
            finished = win.remaining == 0
            if finished:
                self.deactivate(win.first)
            self.tokens += k + 1
            results.append(WindowResult(win.key, win.first, fed, hidden[i][0, : k + 1], next_id, finished, k))
        return results

    def _advance(self, win: _Window, fed: torch.Tensor, k: torch.Tensor, token: torch.Tensor) -> None:
        """Device side of accepting ``k`` (0-d) drafts of a window that fed ``fed (t,)``: the first
        ``k + 1`` ids are final (repetition-penalty set, sample index, the grid buffer), ``token (1,)``
        (an extended index) is the next ``t0``; the slots' cache index parks at its position."""
        r, seq, state = self.runner, win.seq, win.seq.sampling_state
        t = fed.shape[0]
        final = torch.arange(t, device=r.device) <= k
        rows = torch.ones(win.count, dtype=torch.bool, device=r.device)
        r.sampler.mark_seen(state, torch.where(final, fed, r.eol)[None, :].expand(win.count, t), rows)
        state.sample_idx += k + 1
        span = win.grid[win.fed : win.fed + t]
        span.copy_(torch.where(final, fed, span))
        next_id = torch.where(token == r.vocab, r.eol, token + r.vstart)
        win.grid.scatter_(0, (win.fed + 1 + k).view(1), next_id)
        r.cache_pos[win.first : win.first + win.count] = seq.prompt_len + win.fed + 1 + k

    def _redraft(self, win: _Window, p: torch.Tensor | None, k: int | torch.Tensor, t: int, u: torch.Tensor,
                 token: torch.Tensor) -> None:
        """Draft grid indices ``g' + 1 .. g' + m`` (``g' = g + k + 1``, ``g`` = `_Window.fed` before
        this turn, ``t0`` sits at ``g'``; ``m = window - 1``: drafts past the grid's end are never fed)
        after ``k`` (an int, or a 0-d device tensor: no host sync) accepted drafts of a ``t``-token
        window with targets ``p (t, V + 1)`` (None and ``k = -1``: none yet); ``token (1,)`` is ``t0`` as
        an extended index on the device. Sets the next window's ids."""
        r, seq = self.runner, win.seq
        m = self._window(win) - 1
        vocab, dev = r.vocab, r.device
        offsets = torch.arange(1, m + 1, device=dev)
        base = win.fed + 1 + k  # g'
        index = base + offsets  # grid index of each new draft
        j = k + offsets  # the output of the last forward that predicted it
        has_prediction = (j <= t - 1) if p is not None else torch.zeros(m, dtype=torch.bool, device=dev)
        predicted = p[j.clamp(max=max(t - 1, 0))] if p is not None and m else uniform_proposal(m, vocab, dev)
        init = self._init_proposal(win, index, base)
        previous = None
        if seq.decoding.token_reuse and p is not None:
            old = j.clamp(max=max(len(win.drafts) - 1, 0))  # old draft i sat at grid index g + 1 + i = index
            has_old = j <= len(win.drafts) - 1
            if len(win.drafts):
                previous = (win.drafts[old], win.q[old], has_old)
        eol_position = index % (seq.ar_width + 1) == seq.ar_width
        win.drafts, win.q = draft_positions(predicted, has_prediction, init, eol_position, u[:m], previous)
        extended = torch.cat([token.to(win.drafts.dtype), win.drafts])
        win.ids = torch.where(extended == vocab, r.eol, extended + r.vstart)

    def _init_proposal(self, win: _Window, index: torch.Tensor, base: int | torch.Tensor) -> torch.Tensor:
        """Proposals ``(m, V + 1)`` of the grid positions ``index (m,)`` that no forward predicted:
        uniform, or with ``spatial_init`` the one-hot of the final token one grid row above (where
        there is one: grid indices ``0 .. base`` are known, `_Window.grid`)."""
        r, seq = self.runner, win.seq
        q = uniform_proposal(index.shape[0], r.vocab, r.device)
        if not seq.decoding.spatial_init or not index.numel():
            return q
        above = index - (seq.ar_width + 1)
        known = win.grid[above.clamp(0, win.grid.shape[0] - 1)]
        valid = (above >= 0) & (above <= base) & (known != r.eol)
        one_hot = torch.zeros_like(q).scatter_(1, (known - r.vstart).clamp(0, r.vocab - 1)[:, None], 1.0)
        return torch.where(valid[:, None], one_hot, q)


def expand_state(state: SamplingState, t: int, first_sample: int, fed_ids: torch.Tensor, vstart: int) -> SamplingState:
    """A request's `SamplingState` (``n`` rows) widened to ``n * t`` rows, row ``r * t + j`` sampling
    the window's output ``j``: sample index ``first_sample + j``, repetition-penalty set widened by
    the window's tokens ``fed_ids[: j + 1]`` (``(t,)`` int64 ids on the state's device), CFG partner
    and source rows mapped alike."""
    n, vocab = state.seen.shape
    dev = state.seen.device
    j = torch.arange(t, device=dev)
    grow = {f.name: getattr(state, f.name).repeat_interleave(t, dim=0)
            for f in dataclasses.fields(state) if f.name not in ("uniforms", "uniforms_base")}
    grow["partner"] = (state.partner[:, None] * t + j[None, :]).reshape(-1)
    grow["source"] = (state.source[:, None] * t + j[None, :]).reshape(-1)
    grow["sample_idx"] = (first_sample + j).repeat(n)
    vis = fed_ids.to(dev) - vstart
    window_seen = torch.zeros(t, vocab + 1, dtype=torch.bool, device=dev)  # column ``vocab``: not a code
    window_seen[j, torch.where((vis >= 0) & (vis < vocab), vis, vocab)] = True
    window_seen = window_seen[:, :vocab].long().cumsum(0) > 0
    grow["seen"] = grow["seen"] | window_seen.repeat(n, 1)
    return SamplingState(**grow, uniforms=torch.zeros(n * t, 1, dtype=torch.float64, device=dev))
