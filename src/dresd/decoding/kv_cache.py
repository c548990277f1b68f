"""A sequence's KV cache as preallocated buffers, written in place.

One buffer for keys and one for values, each [layers, kv_heads, capacity, head_dim]: a head's
cached rows are contiguous, the layout the attention kernels read without a copy, and the C
decoder (`kernels/decoder.c`) reaches every layer from one address. A
step writes its rows at [start, start + t) and the capacity grows by doubling when a step
needs more, so appending is amortised O(rows written) instead of transformers'
`DynamicCache`, whose `torch.cat` copies the whole cache at every step.

After a verify step only the accepted path stays: its rows move to the front of the step's
slot (`keep`); the rejected rows are simply left beyond `length`, to be overwritten.
"""

from __future__ import annotations

import torch

INITIAL_CAPACITY = 256  # rows; doubled as needed


class SequenceKV:
    """Keys and values of one sequence for every layer; `length` rows are valid."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.shape = (num_layers, kv_heads, 0, head_dim)
        self.dtype, self.device = dtype, device
        self.key_buffer, self.value_buffer = self._empty(0), self._empty(0)
        self.length = 0

    def _empty(self, capacity: int) -> torch.Tensor:
        layers, kv_heads, _, head_dim = self.shape
        return torch.empty(layers, kv_heads, capacity, head_dim, dtype=self.dtype,
                           device=self.device)

    @property
    def capacity(self) -> int:
        return self.key_buffer.shape[2]

    def reserve(self, rows: int) -> None:
        """Make room for `rows` rows in all, keeping the first `length`."""
        if rows <= self.capacity:
            return
        capacity = max(INITIAL_CAPACITY, self.capacity)
        while capacity < rows:
            capacity *= 2
        grown_keys, grown_values = self._empty(capacity), self._empty(capacity)
        grown_keys[:, :, : self.length] = self.key_buffer[:, :, : self.length]
        grown_values[:, :, : self.length] = self.value_buffer[:, :, : self.length]
        self.key_buffer, self.value_buffer = grown_keys, grown_values

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store rows [start, start + t) of one layer: keys, values [t, kv_heads, head_dim]."""
        end = start + keys.shape[0]
        self.key_buffer[layer, :, start:end] = keys.transpose(0, 1)
        self.value_buffer[layer, :, start:end] = values.transpose(0, 1)

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `end` rows of one layer as [1, kv_heads, end, head_dim] (no copy)."""
        return self.key_buffer[layer, None, :, :end], self.value_buffer[layer, None, :, :end]

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of rows [start, end) of every layer: keys, values [layers, kv_heads, t,
        head_dim] (what the prefix cache keeps of a finished prompt or answer)."""
        return (self.key_buffer[:, :, start:end].clone(),
                self.value_buffer[:, :, start:end].clone())

    def load(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write rows [start, start + t) of every layer from keys, values [layers, kv_heads,
        t, head_dim] (a prefix cache hit) and make them the valid rows' end."""
        end = start + keys.shape[2]
        self.reserve(end)
        self.key_buffer[:, :, start:end] = keys
        self.value_buffer[:, :, start:end] = values
        self.length = end

    def keep(self, prefix_len: int, kept_rows: list[int]) -> None:
        """Keep rows [0, prefix_len) and, after them in this order, rows prefix_len + r for r
        in `kept_rows` (a verified tree's accepted path, root first)."""
        if kept_rows != list(range(len(kept_rows))):  # else: already in place, nothing moves
            source = torch.tensor([prefix_len + row for row in kept_rows], device=self.device)
            target = slice(prefix_len, prefix_len + len(kept_rows))
            for buffer in (self.key_buffer, self.value_buffer):  # every layer at once
                buffer[:, :, target] = buffer[:, :, source]
        self.length = prefix_len + len(kept_rows)
