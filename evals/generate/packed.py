"""The KV cache of a batch whose rows come and go: one preallocated buffer per layer, rows right-aligned.

Row i's cached tokens fill columns [end - length_i, end) of its slot, so every row's newest token
sits in the same column and a query's column distance to a key equals their position distance:
transformers builds the causal, padding and sliding-window masks from a 2D padding mask exactly as
for a left-padded batch. Each step writes one column in place (no `torch.cat` of the whole cache,
which costs O(batch x length) per step in `DynamicCache`); a finished row's slot is refilled by the
next prompt, or the last row moves into it, so the active rows stay slots [0, n). The layers
answer transformers' `Cache` interface (`update`, `get_seq_length`, `get_mask_sizes`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

HEADROOM = 256  # columns reserved ahead of `end`; the buffers are re-laid out when they run out


class _PackedLayer(DynamicLayer):
    """One layer's view of a `PackedKV`: `update` writes the new column, returns the live window."""

    def __init__(self, owner: "PackedKV", index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True  # the buffers exist before the first forward (`PackedKV.insert`)

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        o = self.owner
        n, q = o.rows, key_states.shape[-2]
        kbuf, vbuf = o.keys[self.index], o.values[self.index]
        kbuf[:n, :, o.end:o.end + q] = key_states
        vbuf[:n, :, o.end:o.end + q] = value_states
        self.keys, self.values = kbuf[:n, :, o.start:o.end + q], vbuf[:n, :, o.start:o.end + q]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.owner.end - self.owner.start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0


class PackedKV:
    """KV buffers [slots, kv_heads, columns, head_dim] per layer for up to `slots` rows.

    `lengths[i]`: tokens cached for slot i; `start`..`end`: the live column window (the longest
    row's span). `cache` is what the model's forward takes as its cache.
    """

    def __init__(self, num_layers: int, slots: int):
        self.slots, self.rows = slots, 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []
        self.start = self.end = 0
        self.cache = Cache(layers=[_PackedLayer(self, i) for i in range(num_layers)])

    @property
    def width(self) -> int:
        return self.end - self.start

    def insert(self, slot: int, prefill, length: int) -> None:
        """Put one prompt's cache (a batch-1 `DynamicCache` holding its `length` tokens) into `slot`
        (`slot == rows` appends a row). A layer that kept fewer tokens (a sliding window) is
        right-aligned too: the columns before it lie outside its window, which its mask excludes."""
        if not self.keys:
            self._allocate(prefill, length)
        if length > self.end:
            self._relayout(max(length, self.width))
        for i, layer in enumerate(prefill.layers):
            w = layer.keys.shape[-2]
            self.keys[i][slot, :, self.end - w:self.end] = layer.keys[0]
            self.values[i][slot, :, self.end - w:self.end] = layer.values[0]
        if slot == self.rows:
            self.rows += 1
            self.lengths.append(length)
        else:
            self.lengths[slot] = length
        self._trim()

    def remove(self, slot: int) -> None:
        """Drop `slot`'s row: the last row moves into it (its slot index changes to `slot`)."""
        last = self.rows - 1
        if slot != last:
            for buf in (*self.keys, *self.values):
                buf[slot, :, self.start:self.end] = buf[last, :, self.start:self.end]
            self.lengths[slot] = self.lengths[last]
        self.lengths.pop()
        self.rows -= 1
        self._trim()

    def step_inputs(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention mask [rows, width + 1], position ids [rows, 1]) for one new token per row;
        makes room for the new column first."""
        if self.end + 1 > self._capacity():
            self._relayout(self.width)
        lengths = torch.tensor(self.lengths, device=device)
        mask = torch.arange(self.width + 1, device=device)[None, :] >= (self.width - lengths)[:, None]
        return mask.long(), lengths[:, None]

    def advance(self) -> None:
        """After a forward: every row's new token is now cached."""
        self.end += 1
        self.lengths = [n + 1 for n in self.lengths]

    def _capacity(self) -> int:
        return self.keys[0].shape[2]

    def _allocate(self, prefill, length: int) -> None:
        for layer in prefill.layers:
            _, heads, _, dim = layer.keys.shape
            for bufs, like in ((self.keys, layer.keys), (self.values, layer.values)):
                bufs.append(torch.zeros(self.slots, heads, length + HEADROOM, dim, dtype=like.dtype, device=like.device))
        self.start = self.end = length

    def _relayout(self, new_end: int) -> None:
        """Copy the live window so that it ends at column `new_end`, with HEADROOM free after it."""
        width = self.width
        capacity = max(self._capacity(), new_end + HEADROOM)
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                new = torch.zeros(old.shape[0], old.shape[1], capacity, old.shape[3], dtype=old.dtype, device=old.device)
                new[:, :, new_end - width:new_end] = old[:, :, self.start:self.end]
                bufs[i] = new
        self.start, self.end = new_end - width, new_end

    def _trim(self) -> None:
        """The window starts at the longest active row's first token."""
        self.start = self.end - max(self.lengths, default=0)
