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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph capture streams and cuBLAS workspaces")
def test_captures_of_new_shapes_do_not_grow_gpu_memory_by_a_workspace_each():
    """Each capture warmed up on a new ``torch.cuda.Stream``; PyTorch keeps a cuBLAS workspace (32 MiB
    on Hopper) per stream for the life of the process, so every captured shape (up to 16 per
    device) left one behind. The AR's runner had the same fault (`test_batch_engine`)."""
    import gc

    pipe = tiny_pipeline("cuda", torch.bfloat16)
    graphs = GraphCache()
    after = []
    for rows in (8, 12, 16, 20):  # each condition length is a new shape: a new capture
        cond = torch.randn(rows, pipe.llm_hidden_size, device="cuda", dtype=torch.bfloat16)
        state = DenoiseState(pipe, ImageRequest(cond, None, 64, 48, 3, 4.0, seed=1))
        while not state.done:
            denoise_step(pipe.transformer, [state], graphs)
        del state, cond
        gc.collect()
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    assert graphs.captures == 4
    # graphs share one pool, so their buffers may grow with larger shapes a little; a workspace per
    # capture is 32 MiB each time
    growth = [(b - a) / 2**20 for a, b in zip(after[1:], after[2:])]
    assert all(g < 16 for g in growth), growth
