"""The KV cache of the built-in engine: fixed-size blocks, a block table per request, shared prompts.

Per layer, keys and values live in one pool of ``capacity x BLOCK_TOKENS`` token slots,
``[slots, kv_heads, head_dim]``. A request holds a list of block ids (its *block table*):
its token ``j`` is cached in block ``blocks[j // BLOCK_TOKENS]`` at offset
``j % BLOCK_TOKENS``. So a request holds memory for its own length rounded up to a block,
not for the longest request (the dense rows this replaced did), and requests join and
leave without moving anything.

Blocks are reference-counted. The ``n`` responses of a group share one prompt: the prompt
is prefilled once, the followers' tables point at the leader's blocks, and the first write
into a block held by others copies it first (copy on write: only the prompt's last, partly
filled block is ever copied, once per follower).

A forward reads each row's cache as ``[rows, kv_heads, width, head_dim]`` gathered through
its block table (one ``index_select`` per layer for keys, one for values), and writes each new key and
value into its slot. Padded queries (a row shorter than the longest in the forward) write
into block 0, which is never handed out. `PagedKVCache` is also what a Hugging Face model
sees as ``past_key_values``: its attention layers call ``update(keys, values, layer_idx)``.

Bookkeeping (`allocate`, `fork`, `release`) runs on the engine's event loop between steps;
tensor work (`begin`, `update`: pool growth, block copies, writes, reads) runs in the
forward's worker thread. Left out: sliding-window eviction (a sliding layer gets its window
through the mask, over the full cache), swapping blocks out under memory pressure.
"""

from __future__ import annotations

import numpy as np
import torch

#: Tokens per block (vLLM's default block size).
BLOCK_TOKENS = 16
#: Block 0 is scratch: padded queries write there and unused table entries point there.
SCRATCH = 0


class PagedKVCache:
    """Block-paged key/value pools shared by every running request (see the module docstring)."""

    def __init__(self, device, block_tokens: int = BLOCK_TOKENS) -> None:
        self.device = torch.device(device)
        self.block_tokens = block_tokens
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        """Per layer ``[capacity * block_tokens, kv_heads, head_dim]``; allocated at the first write."""
        self.capacity = 0
        """Blocks the pools hold (block 0 included)."""
        self._refs: list[int] = [1]  # block 0 is never free
        self._free: list[int] = []
        self._copies: list[tuple[int, int]] = []  # (src, dst) block copies before the next forward
        self.peak_bytes = 0
        """Most bytes the pools ever held."""
        self.peak_used_blocks = 0
        """Most blocks ever held by requests at once (after a step's allocations)."""
        # Set by `begin` for the forward in progress.
        self._write: torch.Tensor | None = None  # [rows * q] slots the new keys/values go to
        self._read: torch.Tensor | None = None  # [rows * width] slots each row reads, in order
        self._read_shape = (0, 0)
        self._width = 0

    # ------------------------------------------------------------ bookkeeping (between steps)

    @property
    def used_blocks(self) -> int:
        return len(self._refs) - 1 - len(self._free)

    def block_bytes(self) -> int:
        """Bytes of one block across every layer's keys and values (0 before the first write)."""
        if not self.keys:
            return 0
        per_slot = sum(t[0].numel() * t.element_size() for t in (*self.keys, *self.values))
        return per_slot * self.block_tokens

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def allocate(self, blocks: list[int], first: int, end: int) -> None:
        """Make ``blocks`` (a request's table) hold writable slots for tokens ``first..end-1``.

        Adds blocks up to ``end``; a block in that range shared with another request is
        replaced by a private copy (copied before the next forward).
        """
        bt = self.block_tokens
        for b in range(first // bt, min(len(blocks), -(-end // bt))):
            old = blocks[b]
            if self._refs[old] > 1:
                self._refs[old] -= 1
                blocks[b] = self._take()
                self._copies.append((old, blocks[b]))
        while len(blocks) * bt < end:
            blocks.append(self._take())
        self.peak_used_blocks = max(self.peak_used_blocks, self.used_blocks)

    def fork(self, blocks: list[int]) -> list[int]:
        """A table sharing every block of ``blocks`` (the followers of a shared prompt)."""
        for b in blocks:
            self._refs[b] += 1
        return list(blocks)

    def release(self, blocks: list[int]) -> None:
        """Drop a request's hold on its blocks (a block is free when no request holds it)."""
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
        blocks.clear()

    def clear(self) -> None:
        """Free the pools and every block (``pause(clear_cache=True)``, ``close``)."""
        self.keys, self.values, self.capacity = [], [], 0
        self._refs, self._free, self._copies = [1], [], []

    def _take(self) -> int:
        if self._free:
            b = self._free.pop()
        else:  # a new block id; `begin` grows the pools to hold it
            b = len(self._refs)
            self._refs.append(0)
        self._refs[b] = 1
        return b

    # ------------------------------------------------------------ one forward (worker thread)

    def begin(self, tables: list[list[int]], starts, lens, width_q: int) -> None:
        """Set up a forward: row ``r`` writes its ``lens[r]`` new tokens from column ``starts[r]``
        on (its padded queries write to scratch) and reads columns ``0..width-1``."""
        self._grow(len(self._refs))
        if self._copies and self.keys:
            src = self._slots_of(torch.tensor([s for s, _ in self._copies], device=self.device))
            dst = self._slots_of(torch.tensor([d for _, d in self._copies], device=self.device))
            for pool in (*self.keys, *self.values):
                pool[dst] = pool[src]
        self._copies = []
        # The slot indices are built in numpy: a step's handful of small index ops cost a
        # microsecond each there against several as torch ops (the step is per-op overhead).
        bt = self.block_tokens
        starts, lens = np.asarray(starts, dtype=np.int64), np.asarray(lens, dtype=np.int64)
        width = int((starts + lens).max())
        n_blocks = -(-width // bt)
        table = np.array([t[:n_blocks] + [SCRATCH] * (n_blocks - len(t[:n_blocks])) for t in tables], dtype=np.int64)
        read = (table[:, :, None] * bt + np.arange(bt)).reshape(len(tables), n_blocks * bt)[:, :width]
        if width_q == 1:  # decode: each row writes its one token at column `start`
            write = read[np.arange(len(tables)), starts]
        else:
            cols = starts[:, None] + np.arange(width_q)
            real = np.arange(width_q) < lens[:, None]
            write = np.where(real, np.take_along_axis(read, np.minimum(cols, width - 1), 1), SCRATCH * bt)
        self._read_shape = read.shape
        self._read = torch.from_numpy(np.ascontiguousarray(read).reshape(-1)).to(self.device)
        self._write = torch.from_numpy(np.ascontiguousarray(write).reshape(-1)).to(self.device)
        self._width = width

    def _slots_of(self, blocks: torch.Tensor) -> torch.Tensor:
        """The pool slots of ``blocks`` (block ids, any shape ``[..., n]``) in order: ``[..., n * block_tokens]``."""
        offsets = torch.arange(self.block_tokens, device=self.device)
        return (blocks[..., None] * self.block_tokens + offsets).flatten(-2)

    def _grow(self, blocks: int) -> None:
        if blocks <= self.capacity:
            return
        new = max(blocks, self.capacity + self.capacity // 2, 8)
        if self.keys:
            extra = (new - self.capacity) * self.block_tokens
            for pools in (self.keys, self.values):
                for i, old in enumerate(pools):
                    pools[i] = torch.cat([old, old.new_zeros(extra, *old.shape[1:])])
            self.peak_bytes = max(self.peak_bytes, self.nbytes())
        self.capacity = new

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store a layer's new ``[rows, kv_heads, q, head_dim]`` keys/values; return the rows'
        cache as ``[rows, kv_heads, width, head_dim]`` (what attention reads)."""
        if layer_idx == len(self.keys):  # first write of this layer: allocate its pools
            shape = (self.capacity * self.block_tokens, keys.shape[1], keys.shape[3])
            self.keys.append(keys.new_zeros(shape))
            self.values.append(values.new_zeros(shape))
            self.peak_bytes = max(self.peak_bytes, self.nbytes())
        k_pool, v_pool = self.keys[layer_idx], self.values[layer_idx]
        k_pool.index_copy_(0, self._write, keys.transpose(1, 2).flatten(0, 1))
        v_pool.index_copy_(0, self._write, values.transpose(1, 2).flatten(0, 1))
        # index_select, not advanced indexing: ~5x faster on CPU for these small gathers.
        shape = (*self._read_shape, *k_pool.shape[1:])
        keys = k_pool.index_select(0, self._read).view(shape).transpose(1, 2)
        return keys, v_pool.index_select(0, self._read).view(shape).transpose(1, 2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._width


def step_masks(model_config, positions, width: int, device=None):
    """The attention masks of one forward: query ``i`` of row ``r`` (at ``positions[r, i]``, an
    array or a CPU tensor) sees the row's columns ``<= positions[r, i]`` (within the sliding window
    on sliding layers). Built in numpy (a couple of microseconds, against three torch ops).

    Returns a ``[rows, 1, q, width]`` bool mask (True = attend) on ``device`` (default: CPU), or,
    for a model with several layer types, the per-type dict transformers' decoders accept as
    ``attention_mask``.
    """
    positions = np.asarray(positions)[:, :, None]
    cols = np.arange(width)
    full = cols <= positions

    def tensor(m):
        return torch.from_numpy(m[:, None]).to(device or "cpu")

    layer_types = set(getattr(model_config, "layer_types", None) or ["full_attention"])
    if layer_types == {"full_attention"}:
        return tensor(full)
    window = getattr(model_config, "sliding_window", None)
    masks = {}
    for kind in layer_types:
        if kind == "sliding_attention" and window:
            masks[kind] = tensor(full & (cols > positions - window))
        else:
            masks[kind] = tensor(full)
    return masks
