"""Last-to-arrive finishing for split kernels: the programs that share one output each store their
partial result, take a ticket from a counter, and the program that draws the last ticket combines
the partials and writes the output, in the same launch (no second kernel, no reduce pass).

Used by `stage_ar.gemv` (split-K: the programs of one column block). Tried for the split-KV decode
attention too and measured slower there (one program merging a GQA group serially,
docs/PERFORMANCE.md, issue 17's fifth session), and for W8A8's add + norm + quantize after o_proj and
down_proj (the GEMV's last program doing the row: +0.17 ms per step on the H100, seventeenth session,
removed): a tail one program runs after its ticket is latency no PDL launch overlaps. The combining
program reads the partials in a fixed order (split 0, 1, ...), whichever program arrives last, so the
output's bits do not depend on scheduling. It resets the counter to zero, so the next launch (or
CUDA graph replay) finds it so.

Counters live in buffers kept for the process (`persistent_buffers`), one per kernel site and
weight or cache, so a captured CUDA graph keeps valid addresses; launches sharing one buffer must
run one at a time (one stream), as a model's forward does.
"""

from __future__ import annotations

import torch

try:  # triton ships with CUDA builds of torch; CPU-only installs do not have it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

#: Most buffer sets `persistent_buffers` keeps (a model needs a few hundred: one per layer and site).
MAX_BUFFER_SETS = 4096
_buffers: dict = {}
_retired: list = []

if triton is not None:

    @triton.jit
    def last_arrival(counter_ptr, arrivals):
        """True in the program that arrives ``arrivals``-th at ``counter_ptr`` (an int32 counter at zero
        before the first arrival); call it after storing this program's partials. Every thread's stores
        are ordered before the ticket (a CTA barrier, then a release/acquire atomic at GPU scope), so the
        last program sees all partials; it must read them bypassing L1 (``cache_modifier=".cg"``) and
        call `reset_arrivals`."""
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        return ticket == arrivals - 1

    @triton.jit
    def reset_arrivals(counter_ptr):
        """Set the counter back to zero (in the last program: every other one has already arrived)."""
        tl.atomic_xchg(counter_ptr, 0)


def persistent_buffers(owner: torch.Tensor, site: str, floats: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 scratch buffer of at least ``floats`` elements and ``counters`` int32 counters, all zero when made,
    for split launches at kernel site ``site`` over ``owner`` (a weight, a cache layer: its device,
    address, shape and dtype are the key), kept for the process. Grown (replaced) when a launch needs
    more (the smaller set is kept, never freed: a captured graph may still use it). Call the launch
    once before capturing it, so the set exists outside the graph's memory pool.

    Raises:
        RuntimeError: more than `MAX_BUFFER_SETS` sets (a leak, not a model's need).
    """
    key = (site, owner.device, owner.data_ptr(), tuple(owner.shape), owner.dtype)
    have = _buffers.get(key)
    if have is None or have[0].numel() < floats or have[1].numel() < counters:
        if len(_buffers) + len(_retired) >= MAX_BUFFER_SETS:
            raise RuntimeError(f"split-kernel buffers for more than {MAX_BUFFER_SETS} owners: a leak, not a model")
        if have is not None:
            _retired.append(have)  # a captured graph may still use it: never freed
        have = _buffers[key] = (torch.zeros(max(floats, 1), dtype=torch.float32, device=owner.device),
                                torch.zeros(max(counters, 1), dtype=torch.int32, device=owner.device))
    return have
