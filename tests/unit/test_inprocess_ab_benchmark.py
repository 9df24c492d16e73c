"""`benchmarks/ar_inprocess_ab.py`'s ``noquant`` ablation on the CPU (Triton's interpreter): inside
`quantizers_left_out` the W8A8 GEMV's quantizer launches nothing (zero codes, so the output is the
bias alone) and the add + norm + quantize path returns its stand-ins; outside it, and after it, the
real quantizer runs again. The GPU run times the step with and without them (docs/PERFORMANCE.md,
issue 17's nineteenth session)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ar_inprocess_ab as ab  # noqa: E402

from stage_ar import fp8_activations, gemv, linear  # noqa: E402
from stage_ar.fp8 import FP8_DTYPE  # noqa: E402


def _w8a8(x, w, scale, bias):
    return gemv.gemv(x, w, weight_scale=scale, bias=bias, fp8_compute="fp8")


def test_quantizers_left_out_launch_nothing_inside_and_come_back_after():
    torch.manual_seed(0)
    w = (torch.randn(32, 64) / 8).to(FP8_DTYPE)
    scale, bias = torch.rand(32) + 0.5, torch.randn(32).to(torch.bfloat16)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    before = _w8a8(x, w, scale, bias)
    assert not torch.equal(before, bias.expand(2, -1))

    with ab.quantizers_left_out(ab.LEFT_OUT["all"], (64,), torch.device("cpu"), max_rows=4):
        assert gemv.quantize_rows is not fp8_activations.quantize_rows
        assert linear.quantize_rows is gemv.quantize_rows
        inside = _w8a8(x, w, scale, bias)
        codes, scales, summed = linear.quantize_rows(x, torch.ones(64, dtype=torch.bfloat16), residual=x)
        assert summed is x and not codes.float().any() and torch.equal(scales, torch.ones(2))
    assert torch.equal(inside, bias.expand(2, -1))  # zero codes: only the bias is left

    assert gemv.quantize_rows is fp8_activations.quantize_rows
    assert linear.quantize_rows is fp8_activations.quantize_rows
    assert torch.equal(_w8a8(x, w, scale, bias), before)


def test_as_is_leaves_the_quantizers_alone_and_plain_leaves_the_norm_path():
    assert ab.LEFT_OUT["as_is"] == ()
    with ab.quantizers_left_out(ab.LEFT_OUT["plain"], (64,), torch.device("cpu"), max_rows=2):
        assert gemv.quantize_rows is not fp8_activations.quantize_rows
        assert linear.quantize_rows is fp8_activations.quantize_rows


@pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs CUDA")
def test_a_shape_without_buffers_fails_inside_a_capture():
    x = torch.zeros(3, 96, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with ab.quantizers_left_out(ab.LEFT_OUT["plain"], (64,), x.device, max_rows=2):
        with pytest.raises(RuntimeError, match="no buffers"), torch.cuda.graph(graph):
            gemv.quantize_rows(x)
