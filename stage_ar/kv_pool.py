"""A fixed-capacity key/value pool shared by every running sequence of the batched AR engine.

The pool is one preallocated pair of tensors ``(num_layers, num_slots, num_kv_heads, capacity,
head_dim)``; a sequence owns one slot (two adjacent slots with AR-side CFG: conditional, then
unconditional) from its prefill until it leaves. Allocation is lowest-free-first so the running
sequences stay packed at the front: the batched decode step covers slots ``[0, bucket)`` as a plain
view of the pool (no gather of keys/values).

`KVPool.view` hands a sequence a `KVCache` whose tensors are views of its slots, so the prefill runs
through the unchanged `MammothARForCausalLM.forward` and writes straight into the pool.
"""

from __future__ import annotations

import torch

from stage_ar.configuration_mammoth_ar import MammothARConfig
from stage_ar.modeling_mammoth_ar import KVCache

__all__ = ["KVPool", "PoolFull"]

CAPACITY_ALIGN = 16  # memory-efficient attention wants the key length (mask width) a multiple of 16


class PoolFull(RuntimeError):
    """No run of free adjacent slots is large enough."""


class KVPool:
    """Preallocated keys/values for ``num_slots`` sequences of up to ``capacity`` positions.

    Args:
        config: the AR model's config (layers, KV heads, head width).
        num_slots: slots in the pool.
        capacity: positions per slot; rounded up to a multiple of 16.
        device, dtype: where the tensors live (the model's device and dtype).

    Attributes:
        key, value: ``(num_layers, num_slots, num_kv_heads, capacity, head_dim)``; keys after RoPE.

    Raises:
        ValueError: ``num_slots`` or ``capacity`` below 1.
    """

    def __init__(
        self,
        config: MammothARConfig,
        num_slots: int,
        capacity: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_slots < 1 or capacity < 1:
            raise ValueError(f"KVPool needs num_slots >= 1 and capacity >= 1, got {num_slots}, {capacity}")
        capacity = -(-capacity // CAPACITY_ALIGN) * CAPACITY_ALIGN
        shape = (config.num_hidden_layers, num_slots, config.num_key_value_heads, capacity, config.head_dim)
        self.key = torch.zeros(shape, device=device, dtype=dtype)
        self.value = torch.zeros(shape, device=device, dtype=dtype)
        self.num_slots = num_slots
        self.capacity = capacity
        self._used = [False] * num_slots

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value tensors."""
        return self.key.numel() * self.key.element_size() * 2

    @property
    def free_slots(self) -> int:
        """Slots not owned by any sequence."""
        return self._used.count(False)

    @property
    def high_water(self) -> int:
        """One past the highest slot in use (0 when the pool is empty)."""
        for i in range(self.num_slots - 1, -1, -1):
            if self._used[i]:
                return i + 1
        return 0

    def alloc(self, count: int = 1) -> int:
        """Take the lowest run of ``count`` free adjacent slots and return its first index.

        Raises:
            PoolFull: no such run.
        """
        run = 0
        for i in range(self.num_slots):
            run = run + 1 if not self._used[i] else 0
            if run == count:
                first = i - count + 1
                for j in range(first, i + 1):
                    self._used[j] = True
                return first
        raise PoolFull(f"no {count} adjacent free slots among {self.num_slots} ({self.free_slots} free)")

    def free(self, first: int, count: int = 1) -> None:
        """Give slots ``[first, first + count)`` back (idempotent)."""
        for j in range(first, first + count):
            self._used[j] = False

    def view(self, first: int, count: int = 1) -> KVCache:
        """A `KVCache` of batch ``count`` and this pool's capacity over slots ``[first, first+count)``.

        Its length starts at 0; writes through it land in the pool.
        """
        return KVCache.from_buffers(
            self.key[:, first : first + count], self.value[:, first : first + count], length=0
        )
