"""One process's place in a ``torch.distributed`` group, and the collectives the stages use.

The parallel modes of issue 21 (the AR's tensor parallelism, the DiT's CFG- and sequence
parallelism, each in its stage's package) run one process per GPU in one group: NCCL on GPUs,
gloo in the CPU tests. This module holds only the group handle and thin collective wrappers, so a
stage's sharding code states *what* it exchanges, not how.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["GroupRank"]


@dataclass(frozen=True)
class GroupRank:
    """This process's rank in a group of ``world_size`` ranks.

    Attributes:
        rank: ``0 <= rank < world_size``.
        world_size: processes sharing the work.
        group: the ``torch.distributed`` group; ``None`` = the default (world) group.
        on_failure: called with a reason when a collective raises (timeout, a peer gone), before the
            error propagates: a stage's ranks end the process there (`mammoth_core.rank_group`).
    """

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None
    on_failure: Callable[[str], None] | None = dataclasses.field(default=None, compare=False, repr=False)

    def _run(self, what: str, collective: Callable[[], Any]) -> Any:
        try:
            return collective()
        except Exception as exc:
            if self.on_failure is not None:
                self.on_failure(f"{what} over {self.world_size} ranks failed: {exc}")
            raise

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None) -> GroupRank:
        """This process's place in ``group`` (default: the world group).

        Raises:
            RuntimeError: ``torch.distributed`` is not initialised.
        """
        if not dist.is_initialized():
            raise RuntimeError("parallel modes need torch.distributed.init_process_group() first")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` (pickled) on every rank."""
        box = [obj]
        self._run("broadcast_object_list", lambda: dist.broadcast_object_list(box, src=0, group=self.group))
        return box[0]

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` into ``tensor`` on every rank (in place; returns it)."""
        if self.world_size > 1:
            self._run("broadcast", lambda: dist.broadcast(tensor, src=0, group=self.group))
        return tensor

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place and return it (no-op for one rank)."""
        if self.world_size > 1:
            self._run("all_reduce", lambda: dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group))
        return tensor

    def all_gather_cat(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape on all ranks) concatenated along ``dim`` in rank order."""
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._run("all_gather", lambda: dist.all_gather(parts, tensor.contiguous(), group=self.group))
        return torch.cat(parts, dim=dim)

    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Split ``tensor`` into ``world_size`` equal chunks along ``scatter_dim``, send chunk ``j`` to
        rank ``j``, and concatenate the chunks received (in rank order) along ``gather_dim``.

        Raises:
            ValueError: ``world_size`` does not divide ``tensor.shape[scatter_dim]``.
        """
        if self.world_size == 1:
            return tensor
        if tensor.shape[scatter_dim] % self.world_size:
            raise ValueError(f"dimension {scatter_dim} of size {tensor.shape[scatter_dim]} does not split "
                             f"over {self.world_size} ranks")
        send = [c.contiguous() for c in tensor.chunk(self.world_size, dim=scatter_dim)]
        recv = [torch.empty_like(c) for c in send]
        self._run("all_to_all", lambda: dist.all_to_all(recv, send, group=self.group))
        return torch.cat(recv, dim=gather_dim)
