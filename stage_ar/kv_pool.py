"""A fixed-capacity key/value pool shared by every running sequence of the batched AR engine.

The pool is one preallocated pair of tensors ``(num_layers, num_slots, num_kv_heads, capacity,
head_dim)``; a sequence owns one slot (two adjacent slots with AR-side CFG: conditional, then
unconditional) from its prefill until it leaves. Which slots are free is the scheduler's business
(`stage_ar.scheduler.SlotAllocator`, lowest free first, so the running sequences stay packed at the
front and the batched decode step covers slots ``[0, bucket)`` as a plain view of the pool).

`KVPool.view` hands a sequence a `KVCache` whose tensors are views of its slots, so the prefill runs
through the unchanged `MammothARForCausalLM.forward` and writes straight into the pool.
"""

from __future__ import annotations

import torch

from stage_ar.configuration_mammoth_ar import MammothARConfig
from stage_ar.modeling_mammoth_ar import KVCache

__all__ = ["KVPool"]

CAPACITY_ALIGN = 16  # memory-efficient attention wants the key length (mask width) a multiple of 16


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

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value tensors."""
        return self.key.numel() * self.key.element_size() * 2

    def view(self, first: int, count: int = 1) -> KVCache:
        """A `KVCache` of batch ``count`` and this pool's capacity over slots ``[first, first+count)``.

        Its length starts at 0; writes through it land in the pool.
        """
        return KVCache.from_buffers(
            self.key[:, first : first + count], self.value[:, first : first + count], length=0
        )
