"""Host staging blocks of the hidden-state sender: the fixed pool of (pinned) blocks rows are
copied into on the decode thread, and the side stream of those device->host copies.

A pool is process-wide per ``(pinned, block_bytes)`` (`default_staging_pool`): requests share its
blocks, each block owned by one request from `StagingPool.acquire` until its copy completed and its
bytes were framed (`StagingPool.release`). Exhaustion never blocks: the sender then stages through
pageable memory and counts it (``mammoth_transport_pageable_fallback_total{side="send"}``).
"""

from __future__ import annotations

import logging
import threading

import torch

from mammoth_core.cuda_streams import side_stream

logger = logging.getLogger(__name__)

DEFAULT_STAGING_BLOCKS = 64


class StagingPool:
    """A fixed set of host staging blocks of ``block_bytes`` each (pinned when ``pin``).

    Thread-safe. `acquire` never blocks: it returns None when the pool is exhausted (the caller then
    falls back to pageable memory).
    """

    def __init__(self, block_bytes: int, blocks: int, pin: bool):
        self.block_bytes = int(block_bytes)
        self.pinned = bool(pin)
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        for _ in range(blocks):
            try:
                block = torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=pin)
                block.zero_()  # fault the pages in now, not on the decode thread's hot path
                self._free.append(block)
            except RuntimeError:  # pinned memory exhausted: a smaller pool
                logger.warning("pinned staging pool: allocated %d of %d blocks", len(self._free), blocks)
                break
        self.capacity = len(self._free)

    def acquire(self) -> torch.Tensor | None:
        """A free block (``uint8`` tensor of ``block_bytes``), or None when exhausted."""
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, block: torch.Tensor) -> None:
        """Return a block (only after any copy into it has completed)."""
        with self._lock:
            self._free.append(block)

    @property
    def available(self) -> int:
        """Free blocks now."""
        with self._lock:
            return len(self._free)


_default_pools: dict[tuple[bool, int], StagingPool] = {}
_default_lock = threading.Lock()


def default_staging_pool(block_bytes: int, pin: bool, blocks: int = DEFAULT_STAGING_BLOCKS) -> StagingPool:
    """The process-wide staging pool for ``block_bytes`` blocks (created on first use)."""
    with _default_lock:
        key = (pin, block_bytes)
        if key not in _default_pools:
            _default_pools[key] = StagingPool(block_bytes, blocks, pin)
        return _default_pools[key]


def default_pool_blocks() -> tuple[int, int]:
    """``(capacity, free)`` blocks over the process-wide pools (``mammoth_ar_staging_blocks``)."""
    with _default_lock:
        pools = list(_default_pools.values())
    return sum(p.capacity for p in pools), sum(p.available for p in pools)


def copy_stream(device: torch.device) -> "torch.cuda.Stream":
    """The process-wide side stream for device->host copies on ``device`` (`mammoth_core.cuda_streams`)."""
    return side_stream(device, "d2h-copy")
