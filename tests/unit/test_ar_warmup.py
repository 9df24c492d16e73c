"""The AR engine's warm-up (`stage_ar.warmup`): dummy requests decoded through the engine's own loop
before `DecodeEngine.ready` (which the AR server waits on before its health turns SERVING), leaving
nothing behind that changes a real request.

CPU, float32, the reference fixture's tiny model with a small tokenizer (the GPU's first-request vs
tenth-request latency is measured by `benchmarks/ar_decode.py`).
"""

from __future__ import annotations

import pytest
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


def _real_job(tok, width: int = 3, height: int = 2) -> tuple[DecodeJob, CollectingSink]:
    sink = CollectingSink()
    prompt = tok.encode_t2i_prompt("a red house", width, height)
    return DecodeJob("real", 0, prompt, None, width, height, 11, 1.0, 0, 0.0, 3.0, sink, lambda a, b: None,
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


def _variant(x, weight, **kwargs) -> tuple:
    """What `stage_ar.gemv` autotunes (and compiles) once per process: the weight's shape and dtype
    and the prologue/epilogue flags; not the row count (the tuning key leaves M out)."""
    return (tuple(weight.shape), weight.dtype, kwargs.get("bias") is not None, bool(kwargs.get("swiglu")),
            kwargs.get("cos") is not None, kwargs.get("residual") is not None, kwargs.get("norm_weight") is not None,
            kwargs.get("weight_scale") is not None, kwargs.get("fp8_compute"))


def test_warm_up_launches_every_gemv_variant_a_real_prompt_does(model, tokenizer, monkeypatch):
    """A real text-to-image prompt ends ``<|image start|>{w}*{h}<|image token|>``: two generation ids
    among text ids, so the expert layers route it "mixed" and run the generation qkv without the
    RoPE epilogue (a GEMV variant a text-only or an all-generation call never launches). On the
    GPU the first launch of a variant autotunes it, compiling every candidate: on the H200 the first
    request's prefill took 3,230 ms against 31-61 ms for the next nine (first request 1.71 x the
    tenth, 2026-12-02). The warm-up's prompts must launch every variant a real request does, with
    and without AR-side CFG, with and without a negative prompt."""
    from stage_ar import gemv as gemv_kernels
    from stage_ar.linear import TORCH_LINEAR, GemvLinear, set_linear_backend

    if not gemv_kernels.available(torch.device("cpu")):
        pytest.skip("needs a CPU-only machine (Triton's interpreter; the fixture model runs on the CPU)")
    seen: list[tuple] = []
    real = gemv_kernels.gemv

    def recording(x, weight, **kwargs):
        seen.append(_variant(x, weight, **kwargs))
        return real(x, weight, **kwargs)

    monkeypatch.setattr(gemv_kernels, "gemv", recording)
    set_linear_backend(model, GemvLinear(gemv_kernels.GemvConfig(128, 4, 1)))  # the served (fused) backend
    try:
        engine = _engine(model, tokenizer, warm_up=True)
        engine.run_until_idle()  # warm-up, then ready
        warmed = set(seen)
        seen.clear()
        # Grids of 1 x 2: a code, an EOL fed back, a code, an EOL (every decode input a real one has).
        job, sink = _real_job(tokenizer, 1, 2)  # AR-side CFG, no negative prompt
        jobs = [job] + [
            DecodeJob(name, 0, tokenizer.encode_t2i_prompt("a cat", 1, 2), negative, 1, 2, 5, 1.0, 0, 0.0, scale,
                      CollectingSink(), lambda a, b: None, lambda exc, stats: None)
            for name, negative, scale in (("plain", None, 0.0), ("negative", tokenizer.encode_negative_prompt(), 3.0))
        ]
        for each in jobs:
            engine.run_job(each)
    finally:
        set_linear_backend(model, TORCH_LINEAR)
    assert all(each.sink.finished for each in jobs)
    missing = set(seen) - warmed
    assert not missing, f"GEMV variants first launched by a real request: {sorted(missing, key=str)}"
