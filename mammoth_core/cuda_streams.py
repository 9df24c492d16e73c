"""Process-wide CUDA side streams, one per (device, purpose).

Why not ``torch.cuda.Stream()`` where one is needed: PyTorch caches a cuBLAS workspace (32 MiB on
Hopper, ``CUBLAS_WORKSPACE_CONFIG``) per (cuBLAS handle, stream) for the life of the process, and a
new ``torch.cuda.Stream`` is the next stream of a pool of 32. An object that made its own stream
(an AR model runner's CUDA-graph warm-up, for instance) left one more workspace allocated each time
it was created: measured on the H200, every engine built and dropped in one process kept 32 MiB
(64 MiB with the GEMM attention path), which `torch._C._cuda_clearCublasWorkspaces` alone freed
(docs/PERFORMANCE.md, "AR engine memory"). Reusing one stream per purpose bounds that to one
workspace per purpose and device.

Torch is imported when a stream is first asked for, so CPU-only importers of ``mammoth_core`` (the
gateway, the operator) need no torch.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_streams: dict[tuple[int, str], Any] = {}


def side_stream(device: Any, purpose: str) -> Any:
    """The process-wide ``torch.cuda.Stream`` for ``purpose`` (a short name, e.g. ``"d2h-copy"``) on
    ``device`` (a ``torch.device``/str/int naming a CUDA device; index None: the current device),
    created on first use. Thread-safe.

    Raises:
        ValueError: ``device`` is not a CUDA device, or ``purpose`` is empty.
    """
    import torch

    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"side_stream needs a CUDA device, got {dev}")
    if not purpose:
        raise ValueError("side_stream needs a purpose")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    with _lock:
        key = (index, purpose)
        if key not in _streams:
            _streams[key] = torch.cuda.Stream(device=torch.device("cuda", index))
        return _streams[key]
