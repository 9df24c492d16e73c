"""One text-to-image request's AR state machine: prefill, grid decode, hidden rows out.

`T2ISequence` is the single code path used by the serving engine (``stage_ar/engine.py``, a decode
thread calling `prefill`/`step` between its steps) and by the in-process reference run.

Sequence of events for a grid of ``h x w`` (``w`` codes + 1 EOL per row):

* `prefill` runs the prompt (``P`` tokens), emits its ``P`` hidden rows and samples token 0.
* each `step` feeds the last sampled token, emits that token's hidden row and samples the next.
* after ``h * (w + 1)`` steps every grid token has been fed; the sample drawn then is the
  look-ahead (MODEL.md): it is never fed and has no row. `finished` becomes True.

Totals: ``total_rows = P + h*(w+1)`` rows emitted, ``total_samples = h*(w+1) + 1`` tokens sampled.

AR-side classifier-free guidance (opt-in, ``ar_guidance_scale > 1``; upstream
``Mammothmoda2Model.generate_t2i``): the batch is doubled; the unconditional copy holds the same
prompt but attends only to its last 10 prompt tokens (``attention_mask[B//2:, :-10] = 0``) and takes
its RoPE positions from the cumulative mask as upstream ``get_rope_index`` does (those 10 tokens at
0..9, generated tokens from 10 on). Logits are mixed as ``uncond + scale * (cond - uncond)`` before
sampling, both copies are fed the sampled token, and only the conditional rows are emitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mammoth_core.decoding import SEQUENTIAL, DecodingOptions
from stage_ar.kv_pool import KVCache
from stage_ar.modeling_mammoth_ar import MammothARForCausalLM, build_key_mask
from stage_ar.sampling import GridConstrainedSampler, GridSampler, SamplingState

__all__ = ["CFG_CONTEXT_TOKENS", "RowBatch", "T2ISequence", "cache_rows", "grid_tokens"]

CFG_CONTEXT_TOKENS = 10  # upstream generate_t2i: the unconditional copy keeps the last 10 prompt tokens


def cache_rows(ar_guidance_scale: float) -> int:
    """KV-cache rows (and pool slots) a request needs: 2 with AR-side CFG (``scale > 1``), else 1."""
    return 2 if float(ar_guidance_scale) > 1.0 else 1


def grid_tokens(ar_width: int, ar_height: int) -> int:
    """Tokens of a grid: ``ar_height`` rows of ``ar_width`` codes and one EOL each."""
    return ar_height * (ar_width + 1)


@dataclass
class RowBatch:
    """Hidden-state rows of consecutive positions of one sequence.

    Attributes:
        hidden: ``(rows, hidden)`` last-layer states after the final RMSNorm, in the model dtype and
            on the model's device.
        token_ids: the ``rows`` token ids those states belong to.
        row_offset: position of the first row in the sequence (prompt row 0 = 0).
    """

    hidden: torch.Tensor
    token_ids: list[int]
    row_offset: int

    def __len__(self) -> int:
        return len(self.token_ids)


class T2ISequence:
    """State of one text-to-image request on the AR.

    Args:
        model: the AR model (eval mode), already on ``device`` in ``dtype``.
        prompt_ids: envelope ids (`MammothTokenizer.encode_t2i_prompt`).
        ar_width, ar_height: grid size in tokens; must equal the sampler's.
        sampler: the request's `GridConstrainedSampler` (holds the seeded generator).
        device, dtype: where and in which dtype to run; default: the model's.
        negative_prompt_ids: optional negative prompt, for `negative_rows`.
        ar_guidance_scale: AR-side CFG scale; active only when ``> 1``.
        decoding: how the batched engine decodes the grid (`DecodingOptions`; `step`/`run`, the B=1
            reference, are always sequential).

    Raises:
        ValueError: empty prompt, grid mismatch with the sampler, a model/dtype mismatch, or a
            sequence longer than ``model.config.max_position_embeddings``.
    """

    def __init__(
        self,
        model: MammothARForCausalLM,
        prompt_ids: list[int],
        ar_width: int,
        ar_height: int,
        sampler: GridConstrainedSampler,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        negative_prompt_ids: list[int] | None = None,
        ar_guidance_scale: float = 0.0,
        decoding: DecodingOptions = SEQUENTIAL,
    ) -> None:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if (ar_width, ar_height) != (sampler.ar_width, sampler.ar_height):
            raise ValueError(
                f"grid {ar_width}x{ar_height} differs from the sampler's {sampler.ar_width}x{sampler.ar_height}"
            )
        param = model.lm_head.weight
        self.device = torch.device(device) if device is not None else param.device
        self.dtype = dtype or param.dtype
        if param.dtype != self.dtype or param.device.type != self.device.type:
            raise ValueError(f"model is {param.dtype} on {param.device}, sequence asks {self.dtype} on {self.device}")
        self.model = model
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.negative_prompt_ids = [int(i) for i in negative_prompt_ids] if negative_prompt_ids else None
        self.ar_width = ar_width
        self.ar_height = ar_height
        self.sampler = sampler
        self.ar_guidance_scale = float(ar_guidance_scale)
        self.decoding = decoding
        self.cfg = cache_rows(self.ar_guidance_scale) == 2

        self.prompt_len = len(self.prompt_ids)
        self.grid_tokens = grid_tokens(ar_width, ar_height)
        self.total_rows = self.prompt_len + self.grid_tokens
        self.total_samples = self.grid_tokens + 1
        max_pos = model.config.max_position_embeddings
        if self.total_rows > max_pos:
            raise ValueError(f"sequence of {self.total_rows} tokens exceeds max_position_embeddings {max_pos}")

        self.generated_ids: list[int] = []  # grid tokens fed so far
        self.lookahead_id: int | None = None
        self.tokens_sampled = 0
        self.rows_emitted = 0
        self.finished = False
        self._next_token: int | None = None
        self._kv_cache: KVCache | None = None
        self._position_base: list[int] = [0]
        self.grid_sampler = GridSampler(
            sampler.eol_token_id, sampler.visual_token_start_id, sampler.visual_token_end_id, self.device)
        self.sampling_state: SamplingState | None = None  # built by `prefill`

    # ---- public state machine -------------------------------------------------------------------

    @property
    def prefilled(self) -> bool:
        return self._next_token is not None or self.finished

    @property
    def kv_cache(self) -> KVCache | None:
        """The sequence's cache (``None`` before `prefill` and after `release`)."""
        return self._kv_cache

    @property
    def cache_batch(self) -> int:
        """KV-cache rows this sequence needs: 2 with AR-side CFG (conditional, unconditional), else 1."""
        return 2 if self.cfg else 1

    @property
    def next_token(self) -> int | None:
        """The sampled token the next step feeds (``None`` before `prefill` and once finished)."""
        return self._next_token

    @property
    def key_starts(self) -> list[int]:
        """Per cache row, the first key position it attends to (0; the CFG uncond row ``P - keep``)."""
        if not self.cfg:
            return [0]
        return [0, self.prompt_len - min(CFG_CONTEXT_TOKENS, self.prompt_len)]

    @property
    def position_offsets(self) -> list[int]:
        """Per cache row, RoPE position minus cache index of generated tokens (0; CFG uncond ``keep - P``)."""
        return list(self._position_base)

    def attach_kv_cache(self, cache: KVCache) -> None:
        """Use ``cache`` (e.g. a `stage_ar.kv_pool.KVPool` view) instead of allocating one in `prefill`.

        Raises:
            RuntimeError: after `prefill`.
            ValueError: wrong batch (`cache_batch`), too little capacity, or a non-empty cache.
        """
        if self.prefilled:
            raise RuntimeError("attach_kv_cache() after prefill()")
        if cache.batch_size != self.cache_batch or cache.capacity < self.total_rows or cache.length != 0:
            raise ValueError(
                f"cache batch {cache.batch_size}/capacity {cache.capacity}/length {cache.length} does not fit "
                f"batch {self.cache_batch}, {self.total_rows} positions"
            )
        self._kv_cache = cache

    def record_external_step(self, fed_token: int, sampled_token: int) -> None:
        """Account for one decode step run outside `step` (the batched engine): ``fed_token`` was fed
        (its row emitted) and ``sampled_token`` drawn. Keeps `generated_ids`, `tokens_sampled`,
        `rows_emitted`, `finished` and `lookahead_id` as `step` would.

        Raises:
            RuntimeError: before `prefill`, after `finished`, or ``fed_token`` is not the pending token.
        """
        if not self.prefilled or self.finished or self._next_token is None:
            raise RuntimeError("record_external_step() needs a prefilled, unfinished sequence")
        if int(fed_token) != self._next_token:
            raise RuntimeError(f"fed token {fed_token} differs from the pending sample {self._next_token}")
        self.generated_ids.append(int(fed_token))
        self.rows_emitted += 1
        self.tokens_sampled += 1
        if len(self.generated_ids) == self.grid_tokens:
            self.lookahead_id = int(sampled_token)
            self.finished = True
            self._next_token = None
            self._kv_cache = None
        else:
            self._next_token = int(sampled_token)

    @torch.inference_mode()
    def prefill(self) -> RowBatch:
        """Run the prompt, sample the first grid token and return the ``P`` prompt rows.

        Raises:
            RuntimeError: called twice.
        """
        if self.prefilled:
            raise RuntimeError("prefill() already ran for this sequence")
        batch = 2 if self.cfg else 1
        if self._kv_cache is None:
            self._kv_cache = self.model.new_kv_cache(batch, self.total_rows)
        ids = torch.tensor([self.prompt_ids] * batch, dtype=torch.long, device=self.device)
        positions = torch.arange(self.prompt_len, device=self.device).expand(batch, -1)
        attention_mask = None
        if self.cfg:
            key_mask = build_key_mask(self.key_starts, self.prompt_len, self.device)
            keep = min(CFG_CONTEXT_TOKENS, self.prompt_len)
            # upstream get_rope_index with a mask: cumsum(mask) - 1, masked positions set to 1.
            uncond = key_mask[1, : self.prompt_len].long().cumsum(0) - 1
            uncond = uncond.masked_fill(~key_mask[1, : self.prompt_len], 1)
            positions = torch.stack([positions[0], uncond])
            # generated token g sits at position P + g (cond) and keep + g (uncond).
            self._position_base = [0, keep - self.prompt_len]
            attention_mask = key_mask
        out = self.model(ids, positions, kv_cache=self._kv_cache, attention_mask=attention_mask, compute_logits=False)
        hidden = out.last_hidden_state
        self._sample_next(hidden[:, -1])
        return self._emit(hidden[0], list(self.prompt_ids), 0)

    @torch.inference_mode()
    def step(self) -> RowBatch:
        """Feed the last sampled token and return its hidden row; samples the next token.

        Raises:
            RuntimeError: before `prefill` or after `finished`.
        """
        if not self.prefilled:
            raise RuntimeError("step() before prefill()")
        if self.finished or self._next_token is None:
            raise RuntimeError("step() on a finished sequence")
        token = self._next_token
        g = len(self.generated_ids)
        batch = 2 if self.cfg else 1
        ids = torch.full((batch, 1), token, dtype=torch.long, device=self.device)
        positions = torch.tensor(
            [[self.prompt_len + g + base] for base in self._position_base], dtype=torch.long, device=self.device
        )
        attention_mask = build_key_mask(self.key_starts, self.prompt_len + g + 1, self.device) if self.cfg else None
        out = self.model(ids, positions, kv_cache=self._kv_cache, attention_mask=attention_mask, compute_logits=False)
        self.generated_ids.append(token)
        self._next_token = None
        hidden = out.last_hidden_state
        self._sample_next(hidden[:, -1], fed=token)
        return self._emit(hidden[0], [token], self.prompt_len + g)

    @torch.inference_mode()
    def negative_rows(self) -> RowBatch:
        """Prefill-only forward of the negative prompt (own temporary cache, no sampling).

        Returns:
            ``(N, hidden)`` rows of the negative prompt, ``row_offset`` 0.

        Raises:
            RuntimeError: the sequence has no negative prompt.
        """
        if not self.negative_prompt_ids:
            raise RuntimeError("this sequence has no negative prompt")
        n = len(self.negative_prompt_ids)
        ids = torch.tensor([self.negative_prompt_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(n, device=self.device)[None]
        out = self.model(ids, positions, compute_logits=False)
        return RowBatch(hidden=out.last_hidden_state[0], token_ids=list(self.negative_prompt_ids), row_offset=0)

    def release(self) -> None:
        """Free the KV cache (idempotent); the sequence cannot step afterwards."""
        self._kv_cache = None
        self._next_token = None
        self.finished = True

    def run(self) -> tuple[torch.Tensor, list[int]]:
        """Run to completion (reference path).

        Returns:
            ``(hidden (total_rows, hidden), token_ids)``: prompt then grid tokens, no look-ahead.
        """
        batches = [self.prefill()]
        while not self.finished:
            batches.append(self.step())
        hidden = torch.cat([b.hidden for b in batches], dim=0)
        ids = [t for b in batches for t in b.token_ids]
        return hidden, ids

    # ---- internals ------------------------------------------------------------------------------

    def _init_sampling(self) -> None:
        """The request's `SamplingState` (rows as the KV cache: 1, or 2 with AR-side CFG), with every
        uniform it will use drawn now in one call: one float64 per non-EOL sample, none when greedy
        (``torch.rand(n)`` yields the values of ``n`` scalar draws; the generator ends where a
        draw-per-sample run leaves it)."""
        s = self.sampler
        table = torch.zeros(self.total_samples, dtype=torch.float64)
        if not s.greedy:
            draws = [i for i in range(self.total_samples) if not s.is_eol_position(i)]
            if draws:
                table[torch.tensor(draws)] = torch.rand(len(draws), generator=s.generator, dtype=torch.float64)
        self.sampling_state = SamplingState.for_request(
            s, self.grid_sampler.vocab, self.cache_batch, self.ar_guidance_scale, self.prompt_ids, table, self.device)

    def _sample_next(self, last_hidden: torch.Tensor, fed: int | None = None) -> None:
        """Sample from the last rows ``last_hidden (rows, hidden)`` (after feeding ``fed``)."""
        if self.sampling_state is None:
            self._init_sampling()
        state, sampler = self.sampling_state, self.grid_sampler
        if fed is not None:
            rows = last_hidden.shape[0]
            sampler.mark_seen(state, torch.full((rows,), fed, dtype=torch.long, device=self.device),
                              torch.ones(rows, dtype=torch.bool, device=self.device))
        logits = self.model.compute_logits(last_hidden, sampler.vstart, sampler.vend)
        token = int(sampler(logits, state)[0])
        state.sample_idx += 1
        self.tokens_sampled += 1
        if len(self.generated_ids) == self.grid_tokens:
            self.lookahead_id = token
            self.finished = True
            self._kv_cache = None
        else:
            self._next_token = token

    def _emit(self, hidden: torch.Tensor, token_ids: list[int], offset: int) -> RowBatch:
        self.rows_emitted += len(token_ids)
        return RowBatch(hidden=hidden, token_ids=token_ids, row_offset=offset)
