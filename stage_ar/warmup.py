"""Dummy requests the AR engine decodes before it reports ready, so the first real request runs as
fast as the tenth (issue 17, "served = benchmarked").

What a cold first request would otherwise pay, and what each job here exercises through the engine's
own loop (`stage_ar.engine.DecodeEngine`: schedule -> prefill -> launch -> collect -> emit):

* prefill: cuBLAS handles and heuristics, the SDPA kernels, and the GEMV kernels at every row count
  a short prefill can hit (1, 2, 4, 8, 16 rows; `stage_ar.gemv` tunes once per shape and variant,
  at the first call, with a device sync, compiling every candidate; the decode step's variants were
  already tuned by `ARModelRunner.capture`'s warm-up steps before capture) — prompts of 1, 2, 4, 8
  and 16 tokens, and of 24 and 40 (cuBLAS above the GEMV's 16 rows), then (with two KV slots or
  more) a 64-token prompt with AR-side CFG and a negative prompt (two cache rows, the negative rows).
  Every prompt of 4 tokens or more carries two generation ids where a real one has
  ``<|image start|>`` and ``<|image token|>`` (`stage_ar.tokenization_mammoth`'s envelope), so the
  expert layers route it as they route a real prompt ("mixed": the generation qkv runs without
  the RoPE epilogue, a GEMV variant no text-only or all-generation call launches; on the H200 its
  first tuning cost the first real request 3.2 s of prefill);
* decode: `ARModelRunner.activate`, graph replay (the graphs themselves were captured before, one
  per bucket), the one-step-late readback, the sampler with and without top-k/top-p sorts, `leave`.

Each job's grid is 1 x 1 (two tokens: one code, one EOL). The jobs run one at a time (admission is
never exceeded) and their rows go to a discarding sink; their KV slots are simply reused.
"""

from __future__ import annotations

import logging
import time

from stage_ar.engine import CollectingSink, DecodeEngine, DecodeJob

__all__ = ["PROMPT_LENGTHS", "run_warmup", "warmup_jobs"]

logger = logging.getLogger(__name__)

#: Prompt lengths without CFG (1 row per token), then the CFG + negative prompt job's length.
PROMPT_LENGTHS = (1, 2, 4, 8, 16, 24, 40)
CFG_PROMPT_LENGTH = 64
#: Where the warm-up puts a real prompt's two generation ids, counted from its end: a real one ends
#: ``<|image start|>``, the grid size's text tokens (``{w}*{h}``), ``<|image token|>``
#: (`MammothTokenizer.encode_t2i_prompt`). Which positions does not matter to the routing, only
#: that generation and text ids share the prompt.
_ENVELOPE_TAIL = (-5, -1)


def _prompt(length: int, text_vocab: int, generation_id: int | None) -> list[int]:
    """``length`` text ids below ``text_vocab``; from 5 tokens on, with ``generation_id`` at a real
    envelope's two generation positions (text-only when it is None or the prompt is shorter)."""
    ids = [(7 + 13 * i) % text_vocab for i in range(length)]
    if generation_id is not None and length >= -_ENVELOPE_TAIL[0]:
        for at in _ENVELOPE_TAIL:
            ids[at] = generation_id
    return ids


def warmup_jobs(vocab_size: int, max_sequence_length: int, num_slots: int = 2,
                generation_id: int | None = None) -> list[DecodeJob]:
    """The warm-up `DecodeJob`s (request ids ``warmup-N``): text ids below ``vocab_size`` (pass the
    first generation id, ``gen_vocab_start_index``, where the text vocabulary ends below it) and,
    in prompts of 5 tokens or more, ``generation_id`` where a real prompt has its two generation
    ids; each job fits ``max_sequence_length`` positions (longer ones are left out) and ``num_slots``
    KV slots (the CFG job needs two). The negative prompts are text only, as real ones are."""
    specs = [(n, 0.0, False) for n in PROMPT_LENGTHS] + [(CFG_PROMPT_LENGTH, 2.0, True), (8, 0.0, False)]
    jobs = []
    for i, (length, scale, negative) in enumerate(specs):
        if length + 2 > max_sequence_length or (scale and num_slots < 2):
            continue
        top_k = 8 if i == len(specs) - 1 else 0  # the last one takes the sorted sampler variant
        jobs.append(DecodeJob(
            request_id=f"warmup-{i}", epoch=0, prompt_ids=_prompt(length, vocab_size, generation_id),
            negative_ids=_prompt(length // 2, vocab_size, None) if negative else None, ar_width=1, ar_height=1,
            seed=i, temperature=1.0, top_k=top_k, top_p=0.0, ar_guidance_scale=scale, sink=CollectingSink(),
            on_progress=lambda done, total: None, on_done=lambda exc, stats: None,
        ))
    return jobs


def run_warmup(engine: DecodeEngine) -> tuple[float, int]:
    """Decode `warmup_jobs` through ``engine``'s loop in the calling thread, one at a time (called by
    the engine before it reports ready). A failure is logged, not raised: serving goes on, colder.

    Returns:
        ``(seconds spent, jobs that finished)``.
    """
    t0 = time.perf_counter()
    config = engine.runner.model.config
    first_generation_id = int(config.gen_vocab_start_index)
    jobs = warmup_jobs(min(int(config.vocab_size), first_generation_id), engine.max_sequence_length,
                       engine.runner.num_slots, generation_id=first_generation_id)
    try:
        for job in jobs:
            engine.submit(job)
            engine.step_until_idle()
    except Exception:  # noqa: BLE001 - warm-up only saves time
        logger.exception("AR warm-up failed; the first request may be slower")
    return time.perf_counter() - t0, sum(job.sink.finished for job in jobs)
