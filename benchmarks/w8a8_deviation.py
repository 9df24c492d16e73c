"""Numerical deviation of the FP8 linears at the MammothModa2-Preview AR shapes, on the CPU (torch only).

For each Preview projection (random weights ``randn / sqrt(K)``, 16 activation rows) the output of
bf16 (bf16 weights and activations, float32 accumulation), W8A16 (E4M3 weights, per-channel scales)
and W8A8 (E4M3 activations too, one scale per row: ``fp8_compute="fp8"``) is compared with the float32
linear of the unquantized float32 weights and activations: relative Frobenius error
``||y - y32|| / ||y32||`` and the largest elementwise error over ``max |y32|``. Each path is computed by
`stage_ar.gemv_reference.gemv_reference`, which the kernels match to the dot's summation order
(`tests/unit/test_gemv.py`). Two activation kinds: Gaussian rows, and Gaussian rows with 8 outlier
channels x 50 (per-token scales lose resolution on such rows).

    PYTHONPATH=. python3 benchmarks/w8a8_deviation.py [--shapes o,down]
"""

from __future__ import annotations

import argparse
import json

import torch

from stage_ar.fp8 import quantize_fp8_per_channel
from stage_ar.gemv_reference import gemv_reference

#: Preview AR linear shapes ``name: (weight rows, K)`` (hidden 3584, intermediate 18944, qkv 28 + 2 * 4 heads of 128).
PREVIEW_SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}


def deviation(rows: int, k: int, outliers: bool, seed: int = 0) -> dict:
    """``{path: {"rel": ..., "max_rel": ...}}`` of bf16, W8A16 and W8A8 against the float32 linear."""
    g = torch.Generator().manual_seed(seed)
    w32 = torch.randn(rows, k, generator=g) / k**0.5
    x32 = torch.randn(16, k, generator=g)
    if outliers:
        x32[:, torch.randperm(k, generator=g)[:8]] *= 50.0
    x16, w16 = x32.bfloat16(), w32.bfloat16()
    x32, w32 = x16.float(), w16.float()  # the bf16 checkpoint and activations are the ground truth's inputs
    y32 = x32 @ w32.T
    w8, scale = quantize_fp8_per_channel(w16)
    paths = {
        "bf16": gemv_reference(x16, w16),
        "w8a16": gemv_reference(x16, w8, weight_scale=scale),
        "w8a8": gemv_reference(x16, w8, weight_scale=scale, fp8_compute="fp8"),
    }
    return {name: {"rel": float((y.float() - y32).norm() / y32.norm()),
                   "max_rel": float((y.float() - y32).abs().max() / y32.abs().max())} for name, y in paths.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(PREVIEW_SHAPES), help="comma-separated names")
    args = parser.parse_args()
    results = {}
    for name in args.shapes.split(","):
        rows, k = PREVIEW_SHAPES[name]
        for outliers in (False, True):
            key = f"{name} ({rows}x{k}){' outliers' if outliers else ''}"
            results[key] = r = deviation(rows, k, outliers)
            print(key, " ".join(f"{p}: rel {v['rel']:.2e} max {v['max_rel']:.2e}" for p, v in r.items()), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
