"""Issue 21 on GPUs (skipped without 2 CUDA devices): the AR stage's tensor parallelism over NCCL with
the layers' all-reduces captured in the runner's CUDA graphs.

Two ranks join as the stage's ranks do (`mammoth_core.rank_group.join_ranks`, NCCL), load their
shards of the built-in tiny checkpoint with the stage's loader (float32), and decode one seeded
request with the CUDA default engine (graphs captured over every bucket, collectives inside); the
same request decoded by the unsharded model on ``cuda:0`` is the reference: same tokens, rows within
float32 summation-order error, and graphs really captured.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch
import torch.multiprocessing as mp

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs CUDA: 2 devices (NCCL)")


def _decode(model_bundle):
    from stage_ar.engine import CollectingSink, DecodeEngine, DecodeJob, Role

    b = model_bundle
    engine = DecodeEngine(b.new_sequence, 2, model=b.model, grid_ids=b.grid_ids, max_sequence_length=512,
                          warm_up=False)
    tok = b.tokenizer
    sink = CollectingSink()
    engine.run_job(DecodeJob(
        request_id="tp-cuda", epoch=0, prompt_ids=tok.encode_t2i_prompt("a red house", 4, 4), negative_ids=None,
        ar_width=4, ar_height=4, seed=3, temperature=1.0, top_k=0, top_p=0.0, ar_guidance_scale=0.0, sink=sink,
        on_progress=lambda done, total: None, on_done=lambda exc, stats: None))
    return {"ids": torch.tensor(sink.token_ids[Role.CONDITION]), "hidden": sink.hidden().float().cpu(),
            "graphs": engine.runner.graphs_captured}


def _worker(rank: int, store: str, ckpt: str, cache: str, out: str) -> None:
    sys.path[:0] = [str(ROOT)]
    from mammoth_core.rank_group import RankLaunch, join_ranks
    from stage_ar.loader import load_ar

    ranks = join_ranks(RankLaunch(rank, 2, store, "cuda", 120.0, 300.0, "test"))
    sharded = _decode(load_ar(ckpt, cache, f"cuda:{rank}", torch.float32, tensor_parallel=ranks.data))
    result = {"tp2": sharded}
    if rank == 0:
        result["tp1"] = _decode(load_ar(ckpt, cache, "cuda:0", torch.float32))
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))


def test_tp2_with_cuda_graphs_equals_tp1(tiny_checkpoint, tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(tiny_checkpoint), str(tmp_path / "cache"),
                                      str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert r0["tp2"]["graphs"] > 0
    assert torch.equal(r0["tp2"]["ids"], r0["tp1"]["ids"])
    assert torch.equal(r1["tp2"]["ids"], r0["tp2"]["ids"])
    torch.testing.assert_close(r0["tp2"]["hidden"], r0["tp1"]["hidden"], atol=1e-4, rtol=1e-4)
