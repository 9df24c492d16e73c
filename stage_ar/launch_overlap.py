"""Programmatic dependent launch (PDL) for the decode step's Triton kernels: each kernel may start
while the one before it on the stream is still finishing (CUDA, compute capability 9.0 and up).

Without it, a kernel's programs start only once the previous kernel has completed, so every kernel
boundary of a decode step (about ten per layer) leaves the GPU draining one grid and ramping up the
next: at batch 1 most launches stream a few megabytes in a few microseconds, and the boundary is a
large part of each. With PDL (CUDA's ``cudaLaunchAttributeProgrammaticStreamSerialization``,
Triton's ``launch_pdl``), a kernel's programs may be scheduled on SMs the previous kernel has left;
each first calls `wait_for_predecessor`, which blocks until the previous kernel has completed with
its writes visible (PTX ``griddepcontrol.wait``) and lets the next kernel launch
(``griddepcontrol.launch_dependents``). What overlaps is the launch itself, the scheduling of the
programs and their setup, with the previous kernel's tail; every load and store comes after the
wait, so the results are the same bits as serial launches. A kernel that never waits may not be
launched this way (it could read its inputs before they are written). On the H200 (2026-12-03,
`benchmarks/ar_overlap.py`): bf16 batch-1 step 4.145 -> 4.045 ms, W8A8 3.496 -> 3.100 ms.

``"early"`` (opt-in, issue 17): each kernel lets the next one launch *before* it waits, and the
GEMV loads its first weight tile before its wait (weights are no previous kernel's output, so that
load may overlap the previous kernel's tail; every activation load still comes after the wait): the
same bits again, more of the boundary hidden. On the H200 (2026-12-03, one process per mode): bf16
batch 1 4.347 -> 4.216 ms, W8A8 3.154 -> 3.045 ms, the served shape 4.390 -> 4.351 ms (mid-image
4.331 -> 4.417); processes of one call differed by up to 10 % that day, so it becomes the default
only after `benchmarks/ar_inprocess_ab.py` (one process, variants in turn) agrees.

`MODE` picks the mode (`MODES`); `pdl_enabled` says whether it applies on a device, `pdl_flag` which
flag the kernels get. Inductor's kernels of the decode step get the same (`stage_ar.layers.compiled_ops`). Inside
a CUDA graph the launches become programmatic edges (CUDA 12.3 and up).
"""

from __future__ import annotations

import functools
import os

import torch

try:  # triton ships with CUDA builds of torch; CPU-only installs do not have it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None
    tl = None

#: ``"off"``: serial launches; ``"pdl"``: PDL, every program waits at its entry; ``"early"``: PDL with
#: the next launch allowed before the wait and the GEMV's first weight tile loaded before it. (A fourth mode, a GEMV
#: program asking L2 for its weight rows before its wait, ``cp.async.bulk.prefetch.L2``, measured
#: slower on the H200: bf16 step 4.05 -> 5.06 ms, docs/PERFORMANCE.md; removed.)
MODES = ("off", "pdl", "early")
#: Environment variable that sets `MODE` at import (for side-by-side benchmarks of the modes).
MODE_ENV = "MAMMOTH_AR_LAUNCH_OVERLAP"
MODE = os.environ.get(MODE_ENV, "pdl")
if MODE not in MODES:
    raise ValueError(f"{MODE_ENV} must be one of {MODES}, got {MODE!r}")


#: Triton's interpreter was on when triton was imported (``TRITON_INTERPRET=1``; CPU tests): the one
#: reading of it for `stage_ar`'s kernels (`stage_ar.gemv`, `stage_ar.decode_attention`,
#: `stage_ar.fp8_activations` re-export or use it).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def hopper_or_newer(device: torch.device) -> bool:
    """Whether CUDA ``device`` has compute capability 9.0 or higher (PDL, `pdl_enabled`, needs it).
    False off CUDA."""
    if device.type != "cuda":
        return False
    return _hopper_or_newer(device.index if device.index is not None else torch.cuda.current_device())


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use PDL under `MODE`: False off CUDA (the interpreter
    has no grid dependency control), below compute capability 9.0, or with ``"off"``."""
    if MODE == "off" or triton is None or INTERPRETED:
        return False
    return hopper_or_newer(device)


def pdl_flag(device: torch.device) -> int:
    """The kernels' ``PDL`` flag on ``device``: 0 no PDL (`pdl_enabled` False), 1 ``"pdl"``, 2 ``"early"``."""
    if not pdl_enabled(device):
        return 0
    return 2 if MODE == "early" else 1


#: The most weight tiles a GEMV program may load before its wait (`preload_tiles`): each is held in
#: registers until the wait (a 64 x 256 FP8 tile is 32 registers per thread of 4 warps).
MAX_PRELOAD_TILES = 3
#: Environment variable that sets `PRELOAD_TILES` at import (side-by-side benchmarks).
PRELOAD_ENV = "MAMMOTH_AR_PRELOAD_TILES"
#: Weight tiles each GEMV program loads before its wait, under any mode: None means the mode's own
#: (1 under ``"early"``, 0 otherwise); 0 to `MAX_PRELOAD_TILES` overrides it. The idea (issue 17): under
#: ``"pdl"`` a GEMV's programs are resident while the kernel before them runs, so their first tiles
#: could stream while a latency-bound quantizer or attention leaves HBM idle. Measured slower, so
#: opt-in (H100, 2026-12-07, `benchmarks/ar_inprocess_ab.py OUT 1 preload`, ms per step at 0 / 1 / 0 /
#: 1 / 0 tiles: bf16 5.024 / 5.128 / 5.025 / 5.127 / 5.031, W8A8 3.005 / 3.078 / 3.008 / 3.084 / 3.003;
#: 2 and 3 tiles slower still): the tiles held in registers across the wait cost the loop more.
PRELOAD_TILES: int | None = int(os.environ[PRELOAD_ENV]) if os.environ.get(PRELOAD_ENV) else None
if PRELOAD_TILES is not None and not 0 <= PRELOAD_TILES <= MAX_PRELOAD_TILES:
    raise ValueError(f"{PRELOAD_ENV} must be 0 to {MAX_PRELOAD_TILES}, got {PRELOAD_TILES}")


def preload_tiles() -> int:
    """How many weight tiles a GEMV program loads before its wait (`PRELOAD_TILES`, else 1 under
    ``"early"`` and 0 otherwise). On any device: it changes only when those loads are issued, not a
    result (each tile is multiplied in its turn after the wait, so a row's sums keep their order).

    Raises:
        ValueError: `PRELOAD_TILES` outside 0 to `MAX_PRELOAD_TILES`.
    """
    if PRELOAD_TILES is None:
        return 1 if MODE == "early" else 0
    if not 0 <= PRELOAD_TILES <= MAX_PRELOAD_TILES:
        raise ValueError(f"PRELOAD_TILES must be 0 to {MAX_PRELOAD_TILES}, got {PRELOAD_TILES}")
    return PRELOAD_TILES


def launch_options(pdl: bool) -> dict:
    """Keyword arguments of a Triton launch for ``pdl`` (`pdl_enabled`'s answer)."""
    return {"launch_pdl": True} if pdl else {}


if triton is not None:

    @triton.jit
    def wait_for_predecessor(PDL: tl.constexpr):
        """Under ``PDL`` (`pdl_flag`): block until the previous kernel on the stream has completed and
        its writes are visible, and let the next kernel launch (after the wait under 1, before it under
        2: the next kernel's own wait still waits for this one to complete). Call it before the first
        load of anything a previous kernel writes and before the first store. A no-op under 0."""
        if PDL == 2:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        elif PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
