"""The native backend's KV cache: preallocated per layer, one committed length per row.

Rolling back rejected drafts only lowers a row's length (O(1), no tensor copy): the stale slots
past it are masked out and overwritten by the next forward. Capacity grows by a quarter (at least
min_capacity slots; a rare copy) up to the target's context, so a 131k-context model does not
reserve its full window, and a compiled step, which attends the whole capacity, wastes at most a
quarter of its attention on empty slots (doubling wasted up to half: 2,048 slots for 1,025 keys).
"""

from __future__ import annotations

import weakref

import torch


class CachePool:
    """The KV buffers of the cache that allocated last, lent to the next new cache once that one is
    garbage (a request's cache dies with its request). With --compile on CUDA the graphs replay at
    the addresses they recorded (the cache tensors are static inputs): a fresh allocation per request
    would record every graph again. Stale slots need no clearing: slots at or past a row's length are
    never attended to (and hold finite values, so their zero attention weight keeps them out exactly)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._owner: weakref.ref | None = None

    def lend(self, cache: "NativeCache", batch: int, needed: int) -> bool:
        """Give `cache` the pool's buffers if their last owner is gone and they fit (batch rows, >= needed slots)."""
        if not self.keys or (self._owner is not None and self._owner() is not None):
            return False
        if self.keys[0].shape[0] != batch or self.keys[0].shape[2] < needed:
            return False
        cache.keys, cache.values = list(self.keys), list(self.values)
        self._owner = weakref.ref(cache)
        return True

    def keep(self, cache: "NativeCache") -> None:
        """`cache` allocated new buffers: they are the ones the next cache may reuse."""
        self.keys, self.values, self._owner = list(cache.keys), list(cache.values), weakref.ref(cache)


class NativeCache:
    """keys[l] / values[l]: [B, n_kv, capacity, head_dim]; lengths: [B] committed slots per row.

    Rows may have different lengths (ragged batches): row b's next tokens go to slots
    lengths[b], lengths[b] + 1, ...; keys at or past a row's length are never attended to.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_context: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", min_capacity: int = 256,
                 pool: CachePool | None = None) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_context, self.dtype, self.device = max_context, dtype, torch.device(device)
        self.min_capacity = min_capacity
        self.pool = pool
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []  # [B] plain ints: read by Python every step, never an inference tensor

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def get_seq_length(self) -> int:
        """The longest row's committed length (equal for all rows outside ragged batches)."""
        return max(self.lengths) if self.lengths else 0

    def reserve(self, batch: int, needed: int) -> None:
        """Make room for `needed` slots per row (allocating on first use for `batch` rows)."""
        if self.batch_size == 0:
            self.lengths = [0] * batch
        elif batch != self.batch_size:
            raise ValueError(f"this cache holds {self.batch_size} rows; got a batch of {batch}")
        if needed <= self.capacity:
            return
        if needed > self.max_context:
            raise ValueError(f"{needed} cached positions exceed the target's context of {self.max_context}")
        if not self.keys and self.pool is not None and self.pool.lend(self, batch, needed):
            return
        cap = max(self.min_capacity, self.capacity)
        while cap < needed:
            cap += max(self.min_capacity, cap // 4)
        cap = min(cap, self.max_context)
        shape = (batch, self.num_kv_heads, cap, self.head_dim)
        old = self.capacity
        for store in (self.keys, self.values):
            for layer in range(self.num_layers):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if old:
                    new[:, :, :old] = store[layer]
                if layer < len(store):
                    store[layer] = new
                else:
                    store.append(new)
        if self.pool is not None:
            self.pool.keep(self)

    def rollback(self, length: int) -> None:
        """Drop cached positions >= length in every row (O(1): only the lengths change)."""
        self.lengths = [min(n, length) for n in self.lengths]

    def keep_rows(self, start: int, rows: torch.Tensor) -> None:
        """Keep slots start + rows (ascending) as start, start + 1, ..; drop the rest after start.
        Tree verification keeps the accepted path this way (a copy of len(rows) slots per layer)."""
        n = rows.numel()
        idx = (start + rows).to(self.device)
        for store in (self.keys, self.values):
            for t in store:
                t[:, :, start : start + n] = t[:, :, idx]
        self.rollback(start + n)
