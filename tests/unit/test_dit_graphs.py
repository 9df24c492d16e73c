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


def test_keys_seen_once_are_remembered_within_a_bound():
    """Every key's first step runs eagerly and the key is remembered so that its second step is
    captured. Real traffic brings a new key with every new condition length and batch composition,
    and the set of remembered keys grew without bound over a server's life (a slow leak). It is now
    bounded (least recently seen forgotten first); the first-occurrence path needs no GPU."""
    graphs = GraphCache(max_graphs=4)
    x = torch.zeros(2)
    for n in range(10 * graphs.max_seen):
        out = graphs.run(("shape", n), (x,), lambda t: t + 1)
        assert torch.equal(out, x + 1)
    assert len(graphs._seen) <= graphs.max_seen and graphs.captures == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_least_recently_used_graph_makes_room_for_a_new_shape():
    """At most ``max_graphs`` graphs are kept; when a new shape comes after that, the least recently
    replayed graph is dropped and the new one captured. Before, every shape after the sixteenth ran
    eagerly for the life of the process: real traffic (prompt lengths, batch compositions) reaches
    16 shapes within minutes, after which a 512² step took ≈ 31.5 ms eager instead of ≈ 20 ms
    replayed (H200, docs/PERFORMANCE.md)."""
    graphs = GraphCache(max_graphs=2)
    x = torch.randn(64, device="cuda")

    def run(n: int) -> torch.Tensor:
        return graphs.run(("shape", n), (x[: 8 * n],), lambda t: t * 2 + 1)

    for n in (1, 2):
        for _ in range(3):
            assert torch.equal(run(n), x[: 8 * n] * 2 + 1)
    assert graphs.captures == 2 and len(graphs) == 2
    run(1)  # shape 2 is now the least recently used
    for _ in range(3):
        assert torch.equal(run(3), x[:24] * 2 + 1)
    assert graphs.captures == 3 and graphs.evictions == 1 and len(graphs) == 2
    replays = graphs.replays
    run(1)  # still kept: replayed
    assert graphs.replays == replays + 1
    run(2)  # dropped: eager again (seen before, so it is captured now, evicting shape 3)
    assert graphs.captures == 4 and graphs.evictions == 2 and len(graphs) == 2
    # churning through more shapes than are kept reuses the shared pool: no growth per capture
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(5):
        for n in (1, 2, 3):
            assert torch.equal(run(n), x[: 8 * n] * 2 + 1)
    torch.cuda.synchronize()
    assert graphs.evictions >= 12 and torch.cuda.memory_allocated() - before <= 2**20
