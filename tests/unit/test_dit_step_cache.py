"""Opt-in DiT step cache (`stage_dit.step_cache`) on the tiny reference weights: off is byte-identical,
on skips steps with a measured deviation (the random tiny model only; real weights are the user's to
judge), and a cache-on request does not change its cache-off batch mates."""

from __future__ import annotations

import pytest
import torch
from dit_reference import outputs, pipeline
from test_dit_batching import Collector, job_for

from stage_dit.denoise import DenoiseState, ImageRequest, denoise_step
from stage_dit.engine import DiTEngine
from stage_dit.step_cache import StepCacheConfig


@pytest.fixture(scope="module")
def pipe():
    return pipeline()


@pytest.fixture(scope="module")
def condition(pipe):
    out = outputs()
    return pipe.prepare_conditions(out["cond_last_hidden_states"], out["cond_input_ids"][0], 23)


def request(condition, cache=None, seed=1) -> ImageRequest:
    return ImageRequest(condition, None, 32, 32, 20, 3.0, seed=seed, cache=cache)


def test_off_is_byte_identical(pipe, condition):
    plain = pipe(request(condition), output_type="png")
    assert pipe(request(condition, StepCacheConfig(0.0, 2)), output_type="png") == plain


def test_on_skips_steps_and_reports_the_deviation(pipe, condition):
    """Measured on the tiny random model (20 steps, 32x32, guidance 3): its first-layer residual
    changes by 0.6-1.6 (relative L1) from step to step, so only a high threshold skips: 0.8 -> 4
    skipped steps, max |pixel deviation| 0.07 (of 2.0, the [-1, 1] range), mean 0.009; 1.0 -> 9
    skipped, max 0.12, mean 0.017."""
    reference = pipe(request(condition), output_type="pt")
    for threshold, most_mean_deviation in ((0.8, 0.02), (1.0, 0.04)):
        state = DenoiseState(pipe, request(condition, StepCacheConfig(threshold, 2)))
        while not state.done:
            denoise_step(pipe.transformer, [state])
        image = pipe.postprocess(state.latents, "pt")
        deviation = (image - reference).abs()
        print(f"threshold {threshold}: {state.cache.skipped} of 20 steps skipped, "
              f"max |dev| {deviation.max():.4f}, mean {deviation.mean():.4f}")
        assert 0 < state.cache.skipped <= 20 - 2
        assert 0 < deviation.mean() < most_mean_deviation


def test_warmup_steps_always_run(pipe, condition):
    state = DenoiseState(pipe, request(condition, StepCacheConfig(1.0, 20)))
    while not state.done:
        denoise_step(pipe.transformer, [state])
    assert state.cache.skipped == 0


def test_a_cached_request_leaves_its_batch_mates_unchanged(pipe, condition):
    plain, cached = request(condition, seed=3), request(condition, StepCacheConfig(1.0, 2), seed=4)
    alone_plain, alone_cached = pipe(plain, output_type="latent"), pipe(cached, output_type="latent")
    engine = DiTEngine(pipe, max_batch_requests=4)
    try:
        sinks = [Collector(), Collector()]
        engine.submit(job_for(plain, sinks[0]))
        engine.submit(job_for(cached, sinks[1]))
        for sink in sinks:
            assert sink.done.wait(120)
    finally:
        engine.close()
    assert torch.equal(sinks[0].output, alone_plain)
    assert torch.equal(sinks[1].output, alone_cached)  # the cache decisions are per request, batch-invariant
    assert sinks[1].events[-1].timings.steps_skipped > 0
    assert sinks[0].events[-1].timings.steps_skipped == 0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="threshold"):
        StepCacheConfig(-0.1, 2)
    with pytest.raises(ValueError, match="warmup"):
        StepCacheConfig(0.1, -1)
