"""CUDA graphs of the DiT step forward (`stage_dit.graphs`): replays equal the eager forward, a
shape is captured on its second step, the CPU never uses them."""

from __future__ import annotations

import pytest
import torch

from mammoth_app.make_checkpoint import PREVIEW_TOKENS, tiny_config
from stage_dit.denoise import DenoiseState, ImageRequest, denoise_step
from stage_dit.graphs import GraphCache
from stage_dit.pipeline import MammothDiTPipeline, build_dit_modules


def tiny_pipeline(device: str, dtype: torch.dtype) -> MammothDiTPipeline:
    config, _ = tiny_config(dict(PREVIEW_TOKENS))
    torch.manual_seed(0)
    return MammothDiTPipeline(build_dit_modules(config, device=device, dtype=dtype), config, device=device,
                              dtype=dtype)


def test_cpu_pipeline_has_no_graphs():
    assert tiny_pipeline("cpu", torch.float32).step_graphs is None


def test_bad_limit_is_refused():
    with pytest.raises(ValueError):
        GraphCache(max_graphs=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replayed_steps_equal_eager_steps():
    pipe = tiny_pipeline("cuda", torch.bfloat16)
    cond = torch.randn(12, pipe.llm_hidden_size, device="cuda", dtype=torch.bfloat16)
    request = ImageRequest(cond, None, 64, 48, 5, 4.0, seed=3)
    graphs = GraphCache()
    with_graphs, eager = DenoiseState(pipe, request), DenoiseState(pipe, request)
    while not eager.done:
        denoise_step(pipe.transformer, [with_graphs], graphs)
        denoise_step(pipe.transformer, [eager], None)
    assert graphs.captures == 1 and graphs.replays == 4  # step 1 eager, step 2 captured, 2-5 replayed
    assert torch.equal(with_graphs.latents, eager.latents)
