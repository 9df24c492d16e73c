"""CUDA graphs of the DiT forward, one per step shape (resolution and batch composition).

At 512² a CFG step launches ≈ 800 kernels for ≈ 20 ms of GPU work, so the host's launch time is the
step time; replayed as one graph the forward runs back to back (docs/PERFORMANCE.md, "DiT per-step
speed"). `GraphCache.run` keys a graph by everything that fixes the forward's shapes and host-side
control flow: the latents' shape, the conditions' lengths (they decide the attention slices) and the
dtypes. A key's first step runs eagerly (it also compiles any kernel the shapes need); its second
is captured (after one warm-up on a side stream) and every later one replays it with the new
inputs copied into the graph's static buffers. The output is cloned before the lock is released,
so callers on several threads never see each other's results.

All graphs share one memory pool (they never run concurrently: one lock, one stream order), so
their intermediate buffers overlap; at most `max_graphs` are kept: a new shape captured beyond that
drops the least recently replayed graph (real traffic brings new condition lengths and batch
compositions all the time; without eviction every shape after the first `max_graphs` ran eagerly for
the life of the process). The keys seen once (whose next step captures) are remembered within
`max_seen`, least recently seen forgotten first.
A capture that fails logs a warning and leaves that key eager (while it is remembered, `max_seen`). Capture uses
``capture_error_mode="thread_local"``: the decode thread may keep allocating and syncing meanwhile.
Values: a replay runs the same kernels on the same shapes as the eager forward, so the output is
bit-identical to it (checked on the H200 by `benchmarks/dit_profile.py` and
`benchmarks/dit_batching.py`, ``graph_vs_eager``). CUDA only; callers pass no cache on the CPU.
A graph reads the weights at the addresses it was captured with: loading weights in place
(``load_state_dict``) is fine, re-allocating them (``module.to(dtype)``) needs a new `GraphCache`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

from mammoth_core.cuda_streams import side_stream

logger = logging.getLogger(__name__)


class GraphCache:
    """Captured forwards by key (see the module docstring).

    Args:
        max_graphs: most graphs kept (0: never capture); a new key beyond it evicts the least
            recently replayed graph.
        max_seen: most keys remembered as seen once, and as failed to capture (each bounded alone).

    Attributes:
        captures, replays, evictions: counts so far (for tests, logs and benchmarks).
    """

    def __init__(self, max_graphs: int = 16, max_seen: int = 1024) -> None:
        if max_graphs < 0:
            raise ValueError(f"max_graphs must be >= 0, got {max_graphs}")
        if max_seen < 1:
            raise ValueError(f"max_seen must be >= 1, got {max_seen}")
        self.max_graphs = max_graphs
        self.max_seen = max_seen
        # least recently used first
        self._graphs: OrderedDict[Hashable, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor]] = (
            OrderedDict())
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._failed: OrderedDict[Hashable, None] = OrderedDict()
        self._pool = None
        self._lock = threading.Lock()
        self.captures = 0
        self.replays = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, inputs: tuple[torch.Tensor, ...],
            forward: Callable[..., torch.Tensor]) -> torch.Tensor:
        """``forward(*inputs)``, replayed from a graph once ``key`` was seen before.

        Args:
            key: hashable, equal exactly when ``forward`` runs the same kernels on the same shapes
                (shapes of ``inputs`` are added to it here).
            inputs: CUDA tensors; their values may change from call to call.
            forward: pure function of ``inputs`` (no host syncs, no host reads of tensor values).

        Returns:
            a fresh tensor (the graph's output cloned), equal to ``forward(*inputs)``.
        """
        key = (key, tuple((tuple(x.shape), x.dtype) for x in inputs))
        with self._lock:
            entry = self._graphs.get(key)
            if entry is None:
                if key in self._failed or key not in self._seen or self.max_graphs == 0:
                    self._remember(self._seen, key)
                    return forward(*inputs)
                while len(self._graphs) >= self.max_graphs:  # drop the least recently replayed
                    dropped, _ = self._graphs.popitem(last=False)
                    self._remember(self._seen, dropped)  # seen: captured again at its next step
                    self.evictions += 1
                entry = self._capture(key, inputs, forward)
                if entry is None:
                    return forward(*inputs)
                self._seen.pop(key, None)
            else:
                self._graphs.move_to_end(key)
            graph, static, out = entry
            for buffer, x in zip(static, inputs):
                buffer.copy_(x)
            graph.replay()
            self.replays += 1
            return out.clone()

    def _remember(self, keys: OrderedDict, key: Hashable) -> None:
        """Add ``key`` to ``keys`` as the most recent, forgetting the oldest beyond `max_seen`."""
        keys[key] = None
        keys.move_to_end(key)
        while len(keys) > self.max_seen:
            keys.popitem(last=False)

    def _capture(self, key: Hashable, inputs: tuple[torch.Tensor, ...], forward: Callable[..., torch.Tensor]):
        """Warm up on a side stream, capture ``forward`` over static copies of ``inputs``; None on failure."""
        static = tuple(x.clone() for x in inputs)
        try:
            # one process-wide warm-up stream: a new stream per capture would leave one more cuBLAS
            # workspace (32 MiB) behind each time (`mammoth_core.cuda_streams`)
            side = side_stream(inputs[0].device, "dit-graph-warmup")
            side.wait_stream(torch.cuda.current_stream(inputs[0].device))
            with torch.cuda.stream(side):
                forward(*static)
            torch.cuda.current_stream(inputs[0].device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = forward(*static)
        except Exception:  # the eager forward still works: keep this shape eager
            logger.warning("CUDA graph capture failed for %s; running it eagerly", key[0], exc_info=True)
            self._remember(self._failed, key)
            return None
        self.captures += 1
        self._graphs[key] = (graph, static, out)
        return self._graphs[key]
