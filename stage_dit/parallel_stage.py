"""The DiT stage over ``dit_parallel_size`` GPUs (issue 21): rank 0 serves, every rank runs each
transformer forward.

``mammoth dit --dit-parallel cfg|ulysses`` starts ranks ``1..N-1`` itself (`mammoth_core.rank_group`).
Every rank loads the whole DiT and makes its transformer parallel (`stage_dit.parallel`:
`CFGParallelTransformer` or Ulysses). Rank 0 is the stage (gRPC, slots, the `DiTEngine`, VAE, image
encoding); its pipeline's ``transformer`` becomes a `LeaderTransformer`, which, for every forward the
engine runs, broadcasts the forward's inputs (latents, timesteps, conditions, mask) to the other
ranks and then runs the parallel forward with them. The other ranks (`run_worker`) receive the same
inputs and run the same parallel forward, meeting the same collectives (CFG: one all-gather; Ulysses:
all-to-alls around each attention and one all-gather); their outputs are dropped (rank 0 holds the
same velocity). The DiT forward is stateless (no cache across steps), so the forward's inputs are all
a rank needs: no scheduler state travels.

Idle, rank 0 sends a heartbeat at least every ``timeout / 4`` seconds (at most 5 s), so the workers'
waits stay inside the collective timeout (``distributed_timeout_seconds``), and a hung rank 0 is
noticed by the workers just as a dead worker is noticed by rank 0 (`mammoth_core.rank_group`). The
opt-in first-block step cache and the step CUDA graphs (`stage_dit.graphs`) do not apply to the
parallel forward: the wrapper has the plain forward only, so `denoise_step` runs it eagerly.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import torch
from torch import nn

from mammoth_core.rank_group import JoinedRanks, RankGroup, RankLaunch, join_ranks
from stage_dit.parallel import parallel_transformer

__all__ = ["LeaderTransformer", "ParallelDiT", "run_worker"]

logger = logging.getLogger(__name__)

_FORWARD, _BEAT, _STOP = "forward", "beat", "stop"


def _send(ranks: JoinedRanks, tensors: tuple[torch.Tensor, ...]) -> None:
    ranks.broadcast_object((_FORWARD, [(tuple(t.shape), t.dtype) for t in tensors]))
    for t in tensors:
        ranks.data.broadcast_(t.contiguous().view(torch.uint8) if t.dtype == torch.bool else t.contiguous())


def _receive(ranks: JoinedRanks, specs: list[tuple[tuple[int, ...], torch.dtype]], device: str) -> list[torch.Tensor]:
    out = []
    for shape, dtype in specs:
        wire = ranks.data.broadcast_(torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype,
                                                 device=device))
        out.append(wire.view(torch.bool) if dtype == torch.bool else wire)
    return out


class LeaderTransformer(nn.Module):
    """Rank 0's transformer: each forward's inputs go to every rank first (see the module docstring).

    Args:
        inner: this rank's parallel transformer (`stage_dit.parallel.parallel_transformer`).
        config: the wrapped model's config (the pipeline reads it).
        ranks: the joined ranks (a failed exchange ends the stage there: their ``on_failure``).
        heartbeat_s: idle seconds after which rank 0 sends the workers a heartbeat.

    Same call and result as `MammothTransformer2DModel.forward`.
    """

    def __init__(self, inner: nn.Module, config: Any, ranks: JoinedRanks, heartbeat_s: float) -> None:
        super().__init__()
        self.inner, self._config, self._ranks = inner, config, ranks
        self._lock = threading.Lock()  # one thread at a time on the group: the engine's or the heartbeat's
        self._last = time.monotonic()
        self._heartbeat_s = heartbeat_s
        self._stopped = threading.Event()

    def start_heartbeat(self) -> None:
        """Once every rank waits for forwards: beat whenever no forward went out for a while."""
        threading.Thread(target=self._beat, name="dit-rank-heartbeat", daemon=True).start()

    @property
    def config(self):  # noqa: ANN201 - the inner model's diffusers config
        return self._config

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        with self._lock:
            if self._stopped.is_set():
                raise RuntimeError("the DiT's ranks have stopped")
            _send(self._ranks, inputs)  # a failed exchange ends the stage (the groups' on_failure)
            self._last = time.monotonic()
            return self.inner(*inputs)

    def _beat(self) -> None:
        while not self._stopped.wait(self._heartbeat_s / 4):
            with self._lock:
                if self._stopped.is_set() or time.monotonic() - self._last < self._heartbeat_s:
                    continue
                self._ranks.broadcast_object((_BEAT, None))  # a failure ends the stage (on_failure)
                self._last = time.monotonic()

    def stop(self) -> None:
        """Tell the workers to stop (no forward may follow)."""
        with self._lock:
            self._stopped.set()
            try:
                self._ranks.broadcast_object((_STOP, None))
            except Exception:  # noqa: BLE001 - the workers are killed by the caller anyway
                logger.exception("telling the DiT ranks to stop failed")


def rank_settings(settings: Any, launch: RankLaunch) -> Any:
    """``settings`` for ``launch``'s rank: its device (``cuda:<rank>``), the stage's resolved dtype
    (``auto`` resolves against ``cuda``, bfloat16, not against ``cuda:1``)."""
    dtype = str(settings.resolved_dtype()).removeprefix("torch.")
    return dataclasses.replace(settings, device=launch.rank_device, dtype=dtype)


def _load(settings: Any, ranks: JoinedRanks) -> Any:
    from stage_dit.loader import load_pipeline

    return load_pipeline(rank_settings(settings, ranks.launch))


def run_worker(launch: RankLaunch, settings: Any) -> None:
    """A worker rank: join, load, then run every forward rank 0 sends until it says stop. A forward
    that raises is logged (rank 0's raised the same); a failed exchange raises (the stage fails)."""
    if settings.torch_threads:
        torch.set_num_threads(int(settings.torch_threads))
    ranks = join_ranks(launch)
    pipeline = _load(settings, ranks)
    model = parallel_transformer(pipeline.transformer, settings.dit_parallel, ranks.data)
    ranks.barrier()
    logger.info("DiT rank %d (%s) following rank 0", launch.rank, settings.dit_parallel)
    device = launch.rank_device
    while True:
        kind, specs = ranks.broadcast_object()
        if kind == _STOP:
            return
        if kind == _BEAT:
            continue
        inputs = _receive(ranks, specs, device)
        try:
            with torch.inference_mode():
                model(*inputs)
        except Exception:  # noqa: BLE001 - deterministic failures happen on rank 0 too
            logger.exception("DiT rank %d: a forward failed", launch.rank)


class ParallelDiT:
    """Rank 0's handle on the DiT's ranks (`stage_dit.server.serve` drives it): `start` (main
    thread) -> `join` -> `load` (the pipeline with a `LeaderTransformer`) -> `ready` -> `stop`."""

    def __init__(self, group: RankGroup, settings: Any) -> None:
        self.group, self.settings = group, settings
        self.ranks: JoinedRanks | None = None
        self.leader: LeaderTransformer | None = None

    @classmethod
    def start(cls, settings: Any) -> ParallelDiT:
        """Spawn ranks ``1..dit_parallel_size-1`` (call from the main thread)."""
        group = RankGroup.spawn(
            "dit", settings.parallel_ranks(), settings.resolved_device(), run_worker, settings,
            timeout_s=settings.distributed_timeout_seconds,
            startup_timeout_s=settings.distributed_startup_timeout_seconds, log_format=settings.log_format,
            log_level=settings.log_level)
        return cls(group, settings)

    def join(self) -> None:
        """Join as rank 0 (blocking)."""
        self.ranks = self.group.join()

    def load(self) -> Any:
        """Rank 0's pipeline, its transformer parallel and leading the others."""
        pipeline = _load(self.settings, self.ranks)
        inner = parallel_transformer(pipeline.transformer, self.settings.dit_parallel, self.ranks.data)
        self.leader = LeaderTransformer(inner, pipeline.transformer.config, self.ranks,
                                        heartbeat_s=min(5.0, self.settings.distributed_timeout_seconds / 4))
        pipeline.transformer = self.leader
        return pipeline

    def ready(self) -> None:
        """Wait for every rank to have loaded, then keep the idle workers beating."""
        self.ranks.barrier()
        self.leader.start_heartbeat()

    def stop(self) -> None:
        """After the engine stopped: stop the workers and wait for them."""
        if self.leader is not None:
            self.leader.stop()
        self.group.close()
