"""`benchmarks/grid_barrier.py`'s persistent chain computes what its chain of launches does.

Triton's interpreter runs a grid's programs one at a time, so a grid barrier among several programs
would never open there: the persistent kernel runs with one program (every column block of each
phase in turn, the barrier's counter reaching its target at once), which still walks its phases,
barriers, preloaded first tiles and counter reset. The GPU run checks the outputs of every variant
equal at full size (``same_outputs`` in its JSON)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

grid_barrier = pytest.importorskip("grid_barrier", reason="needs triton")


@pytest.mark.parametrize("preload,poll,n", [(False, 0, 256), (True, 0, 256), (False, 1, 256), (True, 1, 128)])
def test_persistent_chain_gives_the_bits_of_one_launch_per_phase(preload, poll, n):
    k = 256
    phases = 3
    g = torch.Generator().manual_seed(0)
    # float16: the interpreter's tl.dot reads bfloat16 operands as their integer bits
    w = (torch.randn(phases, n, k, generator=g) / k**0.5).to(torch.float16)
    x = torch.randn(k, generator=g).to(torch.float16)
    outs = torch.zeros(phases, k, dtype=torch.float16)
    for i in range(phases):
        grid_barrier._launch_kernel[(n // 32,)](x if i == 0 else outs[i - 1], w[i], outs[i], k, BLOCK_N=32,
                                                BLOCK_K=128, PDL=0)
    launched = outs.clone()
    expected = x.float()
    for i in range(phases):  # each phase rounds its row to float16 before the next reads it; a phase of
        # n < k outputs writes its row's first n columns, the rest stay zero
        expected = torch.cat([(w[i].float() @ expected).to(torch.float16).float(), torch.zeros(k - n)])
    torch.testing.assert_close(launched[-1].float(), expected, rtol=2e-3, atol=2e-3)

    outs.zero_()
    cnt = torch.zeros(2, dtype=torch.int32)
    grid_barrier._persistent_kernel[(1,)](x, w, outs, cnt, k, n, phases, BLOCK_N=32, BLOCK_K=128, PRELOAD=preload,
                                          POLL=poll)
    assert torch.equal(outs, launched)
    assert cnt.tolist() == [0, 0]  # the last program out resets both counters for the next launch
