"""The KV cache of the built-in engine: one preallocated row ("slot") per running request.

Per layer, keys and values live in one tensor ``[slots, kv_heads, capacity, head_dim]``. A
request owns one row; its token ``j`` is cached at column ``j`` (rows are right-padded, so
a row's tokens never move while it runs). The running requests hold the rows ``0..n-1``: a
forward runs on a slice of rows, reads a view ``[lo:hi, :, :width]`` (no stacking, no
copy) and writes each new key/value at its own column with one ``index_put_`` per layer.
When a request leaves, the last row moves into its place (one row copied per layer), so the
rows in use stay contiguous.

`SlotKVCache` is what the model sees as ``past_key_values``: transformers' attention layers
call ``update(keys, values, layer_idx)`` and attend over what it returns, under the 4-d
mask `step_masks` builds. Capacity grows in steps of ``GROW_TOKENS`` columns (a copy of the
buffers each time, once per 256 tokens of the longest request), so the memory held is about
``slots x longest sequence so far``, not ``slots x max_model_len``: dense rows waste what a
paged cache saves when one request is much longer than the others (figures in docs/engine.md). Left out: paged memory, prefix sharing, sliding-window KV
eviction (a sliding-window layer gets its window through the mask, over the full cache).
"""

from __future__ import annotations

import torch

#: Capacity grows to the next multiple of this many tokens (as a 256-token page would).
GROW_TOKENS = 256


class SlotKVCache:
    """Per-layer ``[slots, kv_heads, capacity, head_dim]`` key/value buffers, one row per request."""

    def __init__(self, n_slots: int, device) -> None:
        self.n_slots = n_slots
        self.device = torch.device(device)
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        """Per layer; allocated at the first write (head count and size come from the model)."""
        self.peak_bytes = 0
        """Most bytes the buffers ever held."""
        # Set by `begin` for the forward in progress.
        self._rows = slice(0, 0)
        self._row_index: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._width = 0

    # ------------------------------------------------------------ bookkeeping (between steps)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def reserve(self, length: int) -> None:
        """Make room for columns ``0..length-1`` in every row."""
        if length <= self.capacity:
            return
        new = -(-length // GROW_TOKENS) * GROW_TOKENS
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                grown = old.new_zeros(*old.shape[:2], new, old.shape[3])
                grown[:, :, : self.capacity] = old
                buffers[i] = grown
        self.capacity = new
        self.peak_bytes = max(self.peak_bytes, self.nbytes())

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` cached tokens of row ``src`` into row ``dst``."""
        for buf in (*self.keys, *self.values):
            buf[dst, :, :length] = buf[src, :, :length]

    def clear(self) -> None:
        """Free the buffers (``pause(clear_cache=True)``, ``close``)."""
        self.keys, self.values, self.capacity = [], [], 0

    # ------------------------------------------------------------ one forward

    def begin(self, lo: int, hi: int, positions: torch.Tensor, width: int) -> None:
        """Set up a forward over rows ``lo..hi-1``: row ``r`` writes its query token ``i`` at
        column ``positions[r - lo, i]``; attention reads columns ``0..width-1``."""
        self.reserve(int(positions.max()) + 1)
        self._rows = slice(lo, hi)
        self._row_index = torch.arange(lo, hi, device=self.device)[:, None].expand_as(positions)
        self._positions = positions
        self._width = width

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by each attention layer: store ``[rows, heads, q, dim]`` and return the rows' cache."""
        if layer_idx == len(self.keys):  # first write of this layer: allocate it
            shape = (self.n_slots, keys.shape[1], self.capacity, keys.shape[3])
            self.keys.append(keys.new_zeros(shape))
            self.values.append(values.new_zeros(shape))
            self.peak_bytes = max(self.peak_bytes, self.nbytes())
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        # Advanced indices around a slice put the indexed dims first: [rows, q, heads, dim].
        k_buf[self._row_index, :, self._positions] = keys.transpose(1, 2)
        v_buf[self._row_index, :, self._positions] = values.transpose(1, 2)
        return k_buf[self._rows, :, : self._width], v_buf[self._rows, :, : self._width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._width


def step_masks(model_config, positions: torch.Tensor, width: int):
    """The attention masks of one forward: query ``i`` of row ``r`` (at ``positions[r, i]``)
    sees the row's columns ``<= positions[r, i]`` (within the sliding window on sliding layers).

    Returns a ``[rows, 1, q, width]`` bool mask (True = attend), or, for a model with
    several layer types, the per-type dict transformers' decoders accept as ``attention_mask``.
    """
    cols = torch.arange(width, device=positions.device)
    full = (cols <= positions[:, :, None])[:, None]
    layer_types = set(getattr(model_config, "layer_types", None) or ["full_attention"])
    if layer_types == {"full_attention"}:
        return full
    window = getattr(model_config, "sliding_window", None)
    masks = {}
    for kind in layer_types:
        if kind == "sliding_attention" and window:
            masks[kind] = full & (cols > positions[:, :, None] - window)[:, None]
        else:
            masks[kind] = full
    return masks
