"""The engine's paged KV cache: where keys land, what a forward reads, shared blocks, growth, masks."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from asyncrl.rollouter.engines.builtin.kv_cache import SCRATCH, PagedKVCache, step_masks


def kv(rows, heads, q, dim, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, q, dim, generator=g), torch.randn(rows, heads, q, dim, generator=g)


def step(cache, tables, starts, lens, layer=0, seed=0, heads=2, dim=4):
    """One forward's write + read of one layer: rows feed ``lens[r]`` new tokens from ``starts[r]``."""
    for t, s, n in zip(tables, starts, lens):
        cache.allocate(t, s, s + n)
    cache.begin(tables, starts, lens, max(lens))
    k, v = kv(len(tables), heads, max(lens), dim, seed)
    return k, v, *cache.update(k, v, layer)


def test_tokens_land_in_their_blocks_and_reads_follow_the_table():
    cache = PagedKVCache("cpu", block_tokens=4)
    a, b = [], []
    # Row a feeds a 6-token prompt, row b a 2-token one (its queries 2..5 are padding).
    k, v, keys, values = step(cache, [a, b], [0, 0], [6, 2])
    assert len(a) == 2 and len(b) == 1 and SCRATCH not in a + b
    assert keys.shape == values.shape == (2, 2, 6, 4)
    torch.testing.assert_close(keys[0], k[0], rtol=0, atol=0)  # a reads back what it wrote
    torch.testing.assert_close(keys[1, :, :2], k[1, :, :2], rtol=0, atol=0)
    torch.testing.assert_close(values[1, :, :2], v[1, :, :2], rtol=0, atol=0)
    # Token 5 of row a sits in its second block at offset 1.
    torch.testing.assert_close(cache.keys[0][a[1] * 4 + 1], k[0, :, 5], rtol=0, atol=0)
    # A decode step: b's token 2 goes to offset 2 of its block, nothing else of b moves.
    k2, _, keys2, _ = step(cache, [b], [2], [1], seed=1)
    torch.testing.assert_close(keys2[0, :, :2], k[1, :, :2], rtol=0, atol=0)
    torch.testing.assert_close(keys2[0, :, 2], k2[0, :, 0], rtol=0, atol=0)


def test_fork_shares_blocks_and_the_first_write_copies_the_partial_one():
    cache = PagedKVCache("cpu", block_tokens=4)
    lead = []
    k, _, _, _ = step(cache, [lead], [0], [6])  # blocks: one full, one with 2 of 4 tokens
    follower = cache.fork(lead)
    assert follower == lead and cache.used_blocks == 2
    # Both write token 6 into the shared partial block: the first to write gets a copy.
    kf, _, keys_f, _ = step(cache, [follower], [6], [1], seed=1)
    assert follower[0] == lead[0] and follower[1] != lead[1] and cache.used_blocks == 3
    torch.testing.assert_close(keys_f[0, :, :6], k[0], rtol=0, atol=0)  # the copy kept the prompt
    kl, _, keys_l, _ = step(cache, [lead], [6], [1], seed=2)  # now alone in its block: writes in place
    assert cache.used_blocks == 3
    torch.testing.assert_close(keys_l[0, :, 6], kl[0, :, 0], rtol=0, atol=0)
    torch.testing.assert_close(cache.keys[0][follower[1] * 4 + 2], kf[0, :, 0], rtol=0, atol=0)
    cache.release(follower)
    assert follower == [] and cache.used_blocks == 2  # the shared full block is still held by lead
    cache.release(lead)
    assert cache.used_blocks == 0 and cache.peak_used_blocks == 3


def test_pools_grow_keeping_content_and_count_bytes():
    cache = PagedKVCache("cpu", block_tokens=4)
    first = []
    k, _, _, _ = step(cache, [first], [0], [5])
    before = cache.capacity
    others = [[] for _ in range(before)]
    step(cache, others, [0] * len(others), [4] * len(others), seed=3)  # more blocks than the pools hold
    assert cache.capacity > before
    _, _, keys, _ = step(cache, [first], [5], [1], seed=4)
    torch.testing.assert_close(keys[0, :, :5], k[0], rtol=0, atol=0)
    per_slot = 2 * 2 * 4 * 4  # keys + values, 2 heads of 4 floats
    assert cache.nbytes() == cache.capacity * 4 * per_slot and cache.block_bytes() == 4 * per_slot
    assert cache.peak_bytes == cache.nbytes()
    cache.clear()
    assert cache.nbytes() == 0 and cache.used_blocks == 0 and cache.peak_bytes > 0


def test_step_masks_are_causal_per_row():
    cols = torch.tensor([[2, 3], [0, 1]])  # row 0: 2 cached + 2 new; row 1: a 2-token prompt
    mask = step_masks(SimpleNamespace(), cols, width=4)
    assert mask.shape == (2, 1, 2, 4) and mask.dtype == torch.bool
    assert mask[0, 0].tolist() == [[True, True, True, False], [True, True, True, True]]
    assert mask[1, 0].tolist() == [[True, False, False, False], [True, True, False, False]]


def test_step_masks_sliding_layers_get_their_window():
    config = SimpleNamespace(layer_types=["full_attention", "sliding_attention"], sliding_window=2)
    masks = step_masks(config, torch.tensor([[3]]), width=4)
    assert masks["full_attention"][0, 0, 0].tolist() == [True, True, True, True]
    assert masks["sliding_attention"][0, 0, 0].tolist() == [False, False, True, True]
