"""What one GPU can say about the parallel modes (issue 21) while no multi-GPU machine is lent.

    PYTHONPATH=. python benchmarks/parallel_estimate.py --out "$OUT"

Measured on one GPU, random bf16 weights at MammothModa2-Preview dimensions:
1. AR tensor parallel: batch-1 ms/token of the AR stage's engine (compiled CUDA graphs) for the whole
   model, and for **rank 0's shard of a TP=2 model** (`stage_ar.tensor_parallel.shard_ar_model_`,
   half the heads and MLP width per layer) with its two all-reduces per layer skipped: the compute
   part of a TP=2 token. The all-reduces are NOT measured (one GPU cannot): their payload per token is
   printed (``2 x layers`` sums of ``hidden`` bf16 values), to be added from an NCCL measurement.
2. DiT CFG-parallel: one transformer forward at 1024² over both CFG branches (batch 2, today's step)
   and over one branch (batch 1, what each of 2 CFG-parallel ranks runs), plus the per-step
   all-gather payload (one velocity).
Everything is labelled as an estimate in ``parallel_estimate.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ar_decode import time_variant  # noqa: E402
from full_size import ceilings, random_preview_dit_pipeline, random_preview_modules, timed_cuda  # noqa: E402

from mammoth_core.distributed import GroupRank  # noqa: E402
from mammoth_app.make_checkpoint import preview_config  # noqa: E402


class _ComputeOnly(GroupRank):
    """Rank 0 of a group that is not there: collectives are skipped (compute-only estimate)."""

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def ar_section(config: dict, res: dict, steps: int) -> None:
    from stage_ar.tensor_parallel import shard_ar_model_

    model, _ = random_preview_modules(config, dit=False)
    model.eval().requires_grad_(False)
    time_variant(model, res, "tp1", {}, (1,), steps)
    shard_ar_model_(model, _ComputeOnly(rank=0, world_size=2))
    gc.collect()
    torch.cuda.empty_cache()
    time_variant(model, res, "tp2_rank0_compute", {}, (1,), steps)
    lc = config["llm_config"]
    t = res["timings"]
    res["ar_tp2"] = {
        "tp1_ms_per_token": t["tp1_B1"]["ms_per_step"],
        "tp2_compute_ms_per_token": t["tp2_rank0_compute_B1"]["ms_per_step"],
        "ratio_compute_only": t["tp2_rank0_compute_B1"]["ms_per_step"] / t["tp1_B1"]["ms_per_step"],
        "all_reduces_per_token": 2 * lc["num_hidden_layers"],
        "all_reduce_bytes_each": lc["hidden_size"] * 2,
        "note": "estimate: rank 0's shard with the all-reduces skipped; add 2 x layers NCCL all-reduces",
    }
    print("AR TP=2 estimate", res["ar_tp2"], flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()


@torch.inference_mode()
def dit_section(config: dict, res: dict, size: int, repeat: int) -> None:
    pipe = random_preview_dit_pipeline(config)
    hidden = config["llm_config"]["hidden_size"]
    cond = torch.randn(128, hidden, device="cuda", dtype=torch.bfloat16)
    latents = pipe.prepare_latents(width=size, height=size, seed=0)
    t = torch.tensor(0.5, device="cuda")
    both = pipe._batch_conditions([cond, cond.new_zeros(0, hidden)])
    one = pipe._batch_conditions([cond])
    two_ms = timed_cuda(lambda: pipe._velocity(latents, t, None, both), repeat=repeat, warmup=2)
    one_ms = timed_cuda(lambda: pipe._velocity(latents, t, None, one), repeat=repeat, warmup=2)
    res["dit_cfg_parallel"] = {
        "size": size, "both_branches_ms": two_ms, "one_branch_ms": one_ms, "ratio": one_ms / two_ms,
        "all_gather_bytes_per_step": latents.numel() * 2,
        "note": "estimate: each of 2 CFG-parallel ranks runs one branch; add one all-gather per step",
    }
    print("DiT CFG-parallel estimate", res["dit_cfg_parallel"], flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--size", type=int, default=1024)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                 "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "command": "PYTHONPATH=. python benchmarks/parallel_estimate.py --out $OUT",
                 "ceilings": ceilings()}
    config, _ = preview_config()
    ar_section(config, res, args.steps)
    dit_section(config, res, args.size, 10)
    (out / "parallel_estimate.json").write_text(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
