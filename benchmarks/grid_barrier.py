"""What a kernel boundary costs a chain of weight-streaming GEMVs, against a grid-wide barrier inside
one persistent kernel (issue 17: is a persistent decoder layer worth building?).

    PYTHONPATH=. python3 benchmarks/grid_barrier.py "$OUT/grid_barrier.json"

A W8A8 decoder layer at batch 1 is about ten dependent launches; each boundary drains one grid and
ramps the next, and PDL (`stage_ar.launch_overlap`) hides only the launch itself. A persistent kernel
would keep one program per SM resident for the whole chain and replace each boundary by a grid
barrier: every program stores its part of the phase's output, takes a ticket from one counter, and
waits until all have (cooperative groups' ``grid.sync`` done with Triton atomics). This measures both
on the same chain: ``L`` GEMVs at M = 1, phase ``i`` reading the row phase ``i - 1`` wrote, each over
its own weight (the chain streams more than L2 holds), captured in one CUDA graph:

- ``launches_off`` / ``launches_pdl``: one launch per GEMV (one program per column block), serial or
  with programmatic dependent launch;
- ``persistent``: one launch of ``min(blocks, SMs)`` programs that walk the column blocks of each
  phase in turn, a grid barrier between phases;
- ``persistent_preload``: the same, each program loading its next block's first weight tile before
  the barrier (weights are no phase's output);
- ``persistent_poll_loads``: the barrier polled by volatile loads instead of atomics.

Shapes: ``tiny`` (256 x 256: the boundary alone), ``o_fp8_bytes`` (1,792 x 3,584 bf16 = 12.8 MB, the
bytes of W8A8's o_proj) and ``o_bf16`` (3,584 x 3,584, 25.7 MB). Per phase: µs, the µs its bytes take
at the copy bandwidth measured in the same run, and the difference (what the boundary and the
launch's ramp and tail cost). The outputs of every variant are checked equal (same tiles, same
order). The persistent form must not run under Triton's interpreter (it runs programs one at a time,
so a grid barrier would never open): GPU only.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path[:0] = [os.path.join(os.getcwd(), "benchmarks"), os.getcwd()]

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import gemv as B  # noqa: E402 - benchmarks/gemv.py: copy bandwidth
from gpu_state import snapshot  # noqa: E402
from stage_ar.launch_overlap import wait_for_predecessor  # noqa: E402

PHASES = 16
BLOCK_K = 256
SHAPES = {"tiny": (256, 256), "o_fp8_bytes": (1792, 3584), "o_bf16": (3584, 3584)}


@triton.jit
def _block(x_ptr, w_ptr, out_ptr, blk, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, w_first,
           FIRST_LOADED: tl.constexpr):
    """Column block ``blk`` of ``out = W @ x`` (one row; ``W (N, K)`` bf16 row-major, ``K % BLOCK_K == 0``):
    the accumulator is ``(BLOCK_N, 16)`` as in `stage_ar.gemv`, x read past L1 (another program wrote it
    in this launch). ``FIRST_LOADED``: ``w_first`` is the block's first weight tile, already loaded."""
    rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, 16), tl.float32)
    k_start = 0
    if FIRST_LOADED:
        x_t = tl.load(x_ptr + offs_k[:, None] + offs_m[None, :] * 0, mask=(offs_m < 1)[None, :], other=0.0,
                      cache_modifier=".cg")
        acc = tl.dot(w_first, x_t, acc)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        k = k0 + offs_k
        x_t = tl.load(x_ptr + k[:, None] + offs_m[None, :] * 0, mask=(offs_m < 1)[None, :], other=0.0,
                      cache_modifier=".cg")
        w = tl.load(w_ptr + rows[:, None] * K + k[None, :])
        acc = tl.dot(w, x_t, acc)
    y = tl.sum(tl.where((offs_m < 1)[None, :], acc, 0.0), axis=1)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty))


@triton.jit
def _launch_kernel(x_ptr, w_ptr, out_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One GEMV of the chain, one program per column block."""
    wait_for_predecessor(PDL)
    _block(x_ptr, w_ptr, out_ptr, tl.program_id(0), K, BLOCK_N, BLOCK_K, 0, False)


@triton.jit
def _grid_barrier(cnt_ptr, target, POLL: tl.constexpr):
    """Wait until ``target`` arrivals are counted at ``cnt_ptr`` (this program's included): every
    thread's stores ordered before the ticket (a CTA barrier, a release atomic at GPU scope). ``POLL``
    0: polled by acquire atomics; 1: by volatile loads (no read-modify-write at the counter's L2
    slice), then one acquire atomic once the count is seen."""
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    if POLL == 0:
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    else:
        seen = tl.load(cnt_ptr, volatile=True)
        while seen < target:
            seen = tl.load(cnt_ptr, volatile=True)
        tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _persistent_kernel(x_ptr, w_ptr, outs_ptr, cnt_ptr, K, N, phases, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr, POLL: tl.constexpr = 0):
    """The whole chain: phase ``i`` reads row ``i - 1`` of ``outs`` (``(phases, K)``; ``x`` for phase 0)
    and writes the first ``N`` columns of row ``i``, over weight ``w_ptr + i * N * K``; programs take column blocks ``pid, pid + G, ...``; a grid
    barrier between phases (the counter grows by G per phase; the last program to leave resets it)."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    blocks = N // BLOCK_N
    offs_k = tl.arange(0, BLOCK_K)
    w_first = tl.zeros((BLOCK_N, BLOCK_K), w_ptr.dtype.element_ty)
    for i in range(phases):
        src = x_ptr if i == 0 else outs_ptr + (i - 1) * K
        w_i = w_ptr + i * N * K
        for blk in range(pid, blocks, progs):
            first = PRELOAD and (i > 0) and (blk == pid)
            if first:
                _block(src, w_i, outs_ptr + i * K, blk, K, BLOCK_N, BLOCK_K, w_first, True)
            else:
                _block(src, w_i, outs_ptr + i * K, blk, K, BLOCK_N, BLOCK_K, w_first, False)
        if i + 1 < phases:
            if PRELOAD:
                w_first = tl.load(w_ptr + (i + 1) * N * K + (pid * BLOCK_N + tl.arange(0, BLOCK_N))[:, None] * K
                                  + offs_k[None, :])
            _grid_barrier(cnt_ptr, (i + 1) * progs, POLL)
    if tl.atomic_add(cnt_ptr + 1, 1, sem="acq_rel", scope="gpu") == progs - 1:  # the last one out
        tl.atomic_xchg(cnt_ptr, 0)
        tl.atomic_xchg(cnt_ptr + 1, 0)


def _graph_us(fn, reps: int = 50) -> float:
    """Median µs of one replay of ``fn`` captured into a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def measure(name: str, n: int, k: int, sms: int, bandwidth: float) -> dict:
    """Every variant over ``PHASES`` phases of an ``(n, k)`` GEMV; µs per phase and the outputs' check."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(PHASES, n, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    if n != k:  # a chain needs square GEMVs: tile the output to K columns for the next phase's input
        assert k % n == 0
    x = torch.randn(k, device="cuda", generator=g).to(torch.bfloat16)
    outs = torch.zeros(PHASES, k, device="cuda", dtype=torch.bfloat16)
    cnt = torch.zeros(2, dtype=torch.int32, device="cuda")
    block_n = 16
    while n // block_n > sms:
        block_n *= 2
    progs = n // block_n
    result = dict(shape=[n, k], bytes_per_phase=n * k * 2, block_n=block_n, programs=progs, sms=sms,
                  bytes_us=n * k * 2 / bandwidth * 1e6)
    # non-square chains (n < k): phase i reads the first k values of row i - 1, of which the first n
    # are written this launch and the rest stay as made (zeros): the same in every variant

    def launches(pdl: int, bn: int):
        def run():
            for i in range(PHASES):
                src = x if i == 0 else outs[i - 1]
                _launch_kernel[(n // bn,)](src, w[i], outs[i], k, BLOCK_N=bn, BLOCK_K=BLOCK_K, PDL=pdl,
                                           num_warps=4, num_stages=4, **({"launch_pdl": True} if pdl else {}))
        return run

    def persistent(preload: bool, poll: int = 0):
        def run():
            _persistent_kernel[(progs,)](x, w, outs, cnt, k, n, PHASES, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
                                         PRELOAD=preload, POLL=poll, num_warps=4, num_stages=4)
        return run

    variants = {
        "launches_off": launches(0, block_n), "launches_pdl": launches(1, block_n),
        "launches_pdl_bn16": launches(1, 16),
        "persistent": persistent(False), "persistent_preload": persistent(True),
        "persistent_poll_loads": persistent(False, 1),
    }
    reference = None
    for vname, fn in variants.items():
        outs.zero_()
        us = _graph_us(fn) / PHASES
        got = outs.clone()
        if reference is None:
            reference = got
        same = bool(torch.equal(got, reference))
        result[vname] = dict(us_per_phase=round(us, 3), over_bytes_us=round(us - result["bytes_us"], 3),
                             same_outputs=same)
        print(f"{name:12s} {vname:20s} {us:8.3f} us/phase  (bytes {result['bytes_us']:.3f})  same={same}",
              flush=True)
    return result


def main(out: str) -> None:
    props = torch.cuda.get_device_properties(0)
    bandwidth = B.copy_bandwidth()
    result = dict(device=props.name, state=snapshot(), copy_bandwidth_bytes_per_s=bandwidth, phases=PHASES,
                  shapes={})
    for name, (n, k) in SHAPES.items():
        result["shapes"][name] = measure(name, n, k, props.multi_processor_count, bandwidth)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "grid_barrier.json")
