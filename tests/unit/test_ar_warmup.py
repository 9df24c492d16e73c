"""The AR engine's warm-up (`stage_ar.warmup`): dummy requests decoded through the engine's own loop
before `DecodeEngine.ready` (which the AR server waits on before its health turns SERVING), leaving
nothing behind that changes a real request.

CPU, float32, the reference fixture's tiny model with a small tokenizer (the GPU's first-request vs
tenth-request latency is measured by `benchmarks/ar_decode.py`).
"""

from __future__ import annotations

import torch

from stage_ar.engine import CollectingSink, DecodeEngine, DecodeJob, Role
from stage_ar.generation import T2ISequence
from stage_ar.sampling import GridConstrainedSampler
from stage_ar.warmup import PROMPT_LENGTHS, warmup_jobs


def _engine(model, tok, **options) -> DecodeEngine:
    grid = (tok.eol_id, tok.visual_token_start_id, tok.visual_token_end_id)

    def make(job: DecodeJob) -> T2ISequence:
        sampler = GridConstrainedSampler(job.ar_width, job.ar_height, *grid, 1.0, job.top_k or None, 1.0,
                                         torch.Generator().manual_seed(job.seed))
        return T2ISequence(model, job.prompt_ids, job.ar_width, job.ar_height, sampler,
                           negative_prompt_ids=job.negative_ids, ar_guidance_scale=job.ar_guidance_scale)

    return DecodeEngine(make, 2, model=model, grid_ids=grid, max_sequence_length=96, **options)


def _real_job(tok) -> tuple[DecodeJob, CollectingSink]:
    sink = CollectingSink()
    prompt = tok.encode_t2i_prompt("a red house", 3, 2)
    return DecodeJob("real", 0, prompt, None, 3, 2, 11, 1.0, 0, 0.0, 3.0, sink, lambda a, b: None,
                     lambda exc, stats: None), sink


def test_warm_up_runs_before_ready_and_changes_nothing(model, tokenizer):
    warm = _engine(model, tokenizer, warm_up=True)
    assert not warm.ready.is_set() and warm.warmup_s is None
    warm.run_until_idle()  # prepares: capture (none on CPU), warm-up, then ready
    assert warm.ready.is_set() and warm.warmup_s > 0
    assert warm.warmup_jobs == len(warmup_jobs(model.config.vocab_size, 96)) == len(PROMPT_LENGTHS) + 2
    assert warm.steps_total == 0 and warm.running == 0  # counters start at the first real request
    job, sink = _real_job(tokenizer)
    warm.run_job(job)

    cold = _engine(model, tokenizer, warm_up=False)
    cold_job, cold_sink = _real_job(tokenizer)
    cold.run_job(cold_job)
    assert cold.warmup_s is None and cold.warmup_jobs == 0
    assert sink.finished and sink.token_ids[Role.CONDITION] == cold_sink.token_ids[Role.CONDITION]
    assert torch.equal(sink.hidden(), cold_sink.hidden())


def test_warm_up_is_off_by_default_on_cpu_and_jobs_fit_short_pools(model, tokenizer):
    assert _engine(model, tokenizer).warmup_s is None
    engine = _engine(model, tokenizer)
    engine.run_until_idle()
    assert engine.warmup_s is None
    short = warmup_jobs(model.config.vocab_size, 12)  # only the prompts that fit 12 positions
    assert [len(j.prompt_ids) for j in short] == [1, 2, 4, 8, 8]
    assert all(max(j.prompt_ids) < model.config.vocab_size for j in warmup_jobs(model.config.vocab_size, 96))


def test_a_job_waiting_at_the_first_step_skips_the_warm_up(model, tokenizer):
    """Driven inline with a job submitted before the first step (benchmarks do), the engine does not
    warm up in front of it (nor inside it): the job decodes as on a cold engine."""
    engine = _engine(model, tokenizer, warm_up=True)
    job, sink = _real_job(tokenizer)
    engine.submit(job)
    engine.step()
    engine.run_until_idle()
    assert engine.ready.is_set() and engine.warmup_s is None and sink.finished
    cold = _engine(model, tokenizer, warm_up=False)
    cold_job, cold_sink = _real_job(tokenizer)
    cold.run_job(cold_job)
    assert sink.token_ids[Role.CONDITION] == cold_sink.token_ids[Role.CONDITION]


def test_warm_up_on_a_one_slot_pool_runs_every_job_that_fits(model, tokenizer, caplog):
    """With one KV slot the CFG job (two cache rows) cannot be admitted; the warm-up leaves it out
    instead of failing at it (on the H200 it raised "request needs 2 slots; the pool has 1", and
    every job after it, the sorted-sampler one included, never ran)."""
    engine = _engine(model, tokenizer, warm_up=True, kv_slots=1)
    with caplog.at_level("ERROR", logger="stage_ar.warmup"):
        engine.run_until_idle()
    assert "warm-up failed" not in caplog.text
    assert engine.warmup_jobs == len(warmup_jobs(model.config.vocab_size, 96, num_slots=1)) == len(PROMPT_LENGTHS) + 1


def test_warm_up_prefills_two_lengths_above_the_gemv_rows():
    """Prefills above `stage_ar.gemv.MAX_ROWS` rows run the linear, then the compiled RoPE and SwiGLU
    ops (below it, with the epilogues fused, those ops never run). `torch.compile` specialises on
    the first shape it sees and recompiles for dynamic shapes at the second: with one long warm-up
    prompt that second compile landed on the first real request (H200: its prefill took 4,293 ms
    against 47 ms for the next, first request 1.83 x the tenth). Two distinct long lengths (one pool
    slot each: no CFG needed) move both compiles before ready."""
    from stage_ar.gemv import MAX_ROWS

    jobs = warmup_jobs(vocab_size=1000, max_sequence_length=4096, num_slots=1)  # no CFG job on one slot
    long = {len(job.prompt_ids) for job in jobs if len(job.prompt_ids) > MAX_ROWS}
    assert len(long) >= 2, f"prompt lengths above {MAX_ROWS} rows: {sorted(long)}"
