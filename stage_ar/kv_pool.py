"""A fixed-capacity key/value pool shared by every running sequence of the batched AR engine.

The pool is one preallocated pair of tensors ``(num_layers, num_slots, num_kv_heads, capacity,
head_dim)``; a sequence owns one slot (two adjacent slots with AR-side CFG: conditional, then
unconditional) from its prefill until it leaves. Which slots are free is the scheduler's business
(`stage_ar.scheduler.SlotAllocator`, lowest free first, so the running sequences stay packed at the
front and the batched decode step covers slots ``[0, bucket)`` as a plain view of the pool).

`KVCache` is one sequence's (or one request's rows') cache; `KVPool.view` hands a sequence a
`KVCache` whose tensors are views of its slots, so the prefill runs through the one
`MammothARForCausalLM.forward` and writes straight into the pool.
"""

from __future__ import annotations

import torch

from stage_ar.configuration_mammoth_ar import MammothARConfig

__all__ = ["KVCache", "KVPool"]

CAPACITY_ALIGN = 16  # memory-efficient attention wants the key length (mask width) a multiple of 16


class KVCache:
    """Preallocated per-sequence key/value cache.

    Attributes:
        key, value: ``(num_layers, batch, num_kv_heads, capacity, head_dim)`` in the model dtype
            (keys are stored after RoPE).
        length: number of positions filled (the same for every batch row).
        capacity: maximum positions.

    The model writes a forward's new keys at ``[length, length + T)`` in every layer and advances
    `length` once that forward has finished.
    """

    def __init__(
        self,
        config: MammothARConfig,
        batch_size: int,
        capacity: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if batch_size < 1 or capacity < 1:
            raise ValueError(f"KVCache needs batch_size >= 1 and capacity >= 1, got {batch_size}, {capacity}")
        shape = (config.num_hidden_layers, batch_size, config.num_key_value_heads, capacity, config.head_dim)
        self.key = torch.zeros(shape, device=device, dtype=dtype)
        self.value = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0
        self.capacity = capacity
        self.batch_size = batch_size

    @classmethod
    def from_buffers(cls, key: torch.Tensor, value: torch.Tensor, length: int = 0) -> KVCache:
        """A cache over existing tensors (e.g. slots of `stage_ar.kv_pool.KVPool`), no allocation.

        Args:
            key, value: ``(num_layers, batch, num_kv_heads, capacity, head_dim)`` (views allowed;
                writes go through to them).
            length: positions already filled.

        Raises:
            ValueError: the two shapes differ, are not 5-D, or ``length`` is out of range.
        """
        if key.dim() != 5 or key.shape != value.shape:
            raise ValueError(f"key/value must be equal 5-D shapes, got {tuple(key.shape)}, {tuple(value.shape)}")
        if not 0 <= length <= key.shape[3]:
            raise ValueError(f"length {length} outside [0, {key.shape[3]}]")
        cache = cls.__new__(cls)
        cache.key, cache.value = key, value
        cache.length = int(length)
        cache.capacity = int(key.shape[3])
        cache.batch_size = int(key.shape[1])
        return cache

    @property
    def nbytes(self) -> int:
        """Bytes held by the key and value tensors."""
        return self.key.numel() * self.key.element_size() * 2

    @staticmethod
    def bytes_needed(config: MammothARConfig, batch_size: int, capacity: int, dtype: torch.dtype) -> int:
        """Bytes a cache of this size would take (for admission control before allocating):
        ``2 * layers * batch * kv_heads * capacity * head_dim * itemsize``."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize
        return per_position * batch_size * capacity

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``/``value`` ``(batch, kv_heads, T, head_dim)`` after the filled part.

        Returns:
            keys and values of positions ``[0, length + T)`` of this layer.
        """
        end = self.length + key.shape[2]
        self.key[layer, :, :, self.length : end] = key
        self.value[layer, :, :, self.length : end] = value
        return self.key[layer, :, :, :end], self.value[layer, :, :, :end]


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
