"""The engine's slot KV cache: where keys land, what a forward reads, growth, row moves, masks."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from asyncrl.rollouter.kv_batch import GROW_TOKENS, SlotKVCache, step_masks


def kv(rows, heads, q, dim, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, heads, q, dim, generator=g), torch.randn(rows, heads, q, dim, generator=g)


def test_update_writes_each_row_at_its_own_columns():
    cache = SlotKVCache(4, "cpu")
    # Rows 1 and 2: row 1 has 3 cached tokens and feeds 1, row 2 feeds a 2-token prompt.
    cols = torch.tensor([[3, 4], [0, 1]])
    cache.begin(1, 3, cols, width=4)
    k, v = kv(2, 2, 2, 8, seed=0)
    keys, values = cache.update(k, v, layer_idx=0)
    assert cache.capacity == GROW_TOKENS and len(cache.keys) == 1
    assert keys.shape == values.shape == (2, 2, 4, 8)
    torch.testing.assert_close(cache.keys[0][1, :, 3], k[0, :, 0], rtol=0, atol=0)
    torch.testing.assert_close(cache.keys[0][2, :, :2], k[1], rtol=0, atol=0)
    torch.testing.assert_close(cache.values[0][2, :, :2], v[1], rtol=0, atol=0)
    # What the layer attends over is a view of the buffer, not a copy.
    assert keys.data_ptr() == cache.keys[0][1].data_ptr()
    assert not cache.keys[0][0].any() and not cache.keys[0][3].any()  # other rows untouched


def test_growth_keeps_content_and_peak_counts_bytes():
    cache = SlotKVCache(2, "cpu")
    cache.begin(0, 1, torch.arange(5)[None], width=5)
    k, v = kv(1, 1, 5, 4, seed=1)
    cache.update(k, v, 0)
    before = cache.keys[0][0, :, :5].clone()
    cache.reserve(GROW_TOKENS + 1)
    assert cache.capacity == 2 * GROW_TOKENS
    torch.testing.assert_close(cache.keys[0][0, :, :5], before, rtol=0, atol=0)
    assert cache.nbytes() == 2 * (2 * 1 * 2 * GROW_TOKENS * 4) * 4  # keys + values, float32
    assert cache.peak_bytes == cache.nbytes()
    cache.clear()
    assert cache.nbytes() == 0 and cache.peak_bytes > 0


def test_move_row_copies_the_cached_prefix():
    cache = SlotKVCache(3, "cpu")
    cache.begin(0, 3, torch.arange(6).expand(3, 6), width=6)
    k, v = kv(3, 2, 6, 4, seed=2)
    cache.update(k, v, 0)
    cache.move_row(2, 0, length=4)
    torch.testing.assert_close(cache.keys[0][0, :, :4], k[2, :, :4], rtol=0, atol=0)
    torch.testing.assert_close(cache.values[0][0, :, :4], v[2, :, :4], rtol=0, atol=0)
    torch.testing.assert_close(cache.keys[0][1, :, :6], k[1], rtol=0, atol=0)


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
