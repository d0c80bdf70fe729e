"""The running decode batch of the built-in engine: per-request KV caches, left-padded.

Each running request owns a KV cache of its own length. To decode every running request
in one forward, their caches are stacked into one Hugging Face ``DynamicCache`` of shape
``[B, heads, T, head_dim]``, each row left-padded to ``T``, with a 2-d attention mask that
hides the padding (position ids are passed per row, so padding never shifts RoPE).

The stacked cache is kept between decode steps while the batch's members stay the same;
when requests join or leave, rows are dropped/added with a few tensor ops per layer and
the padding every row shares is trimmed. Left out: paged memory, prefix sharing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

#: One request's cache: per layer, keys and values of shape [1, heads, length, head_dim].
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


def cache_layers(cache: DynamicCache) -> LayerKV:
    """The per-layer (keys, values) tensors held by a ``DynamicCache``."""
    return [(layer.keys, layer.values) for layer in cache.layers]


class PaddedKVBatch:
    """A left-padded stack of per-request KV caches, usable as ``past_key_values``."""

    def __init__(self, config, layers: LayerKV, mask: torch.Tensor, ids: list[str]) -> None:
        self._config = config
        self.cache = DynamicCache(ddp_cache_data=layers, config=config)
        self.mask = mask
        """[B, T] int64; 1 marks a real cached token, 0 left padding."""
        self.ids = ids
        """Request id of each row, in row order."""

    @classmethod
    def build(cls, config, rows: dict[str, LayerKV]) -> PaddedKVBatch:
        """Stack single-request caches (``rows``: request id -> its cache) into one batch."""
        return cls._stack(config, None, [], rows)

    def rebuilt(self, keep_ids: list[str], new_rows: dict[str, LayerKV]) -> PaddedKVBatch:
        """A batch of this batch's ``keep_ids`` rows (in that order) followed by ``new_rows``."""
        return self._stack(self._config, self, keep_ids, new_rows)

    def row_lengths(self) -> list[int]:
        return self.mask.sum(1).tolist()

    def step_inputs(self) -> torch.Tensor:
        """The attention mask for one more token per row: the cached mask plus a column of ones."""
        ones = torch.ones(self.mask.shape[0], 1, dtype=self.mask.dtype, device=self.mask.device)
        return torch.cat([self.mask, ones], dim=1)

    def advanced(self, step_mask: torch.Tensor) -> None:
        """Record that the forward with ``step_mask`` appended one token to every row's cache."""
        self.mask = step_mask

    @staticmethod
    def _stack(config, old: PaddedKVBatch | None, keep_ids: list[str], new_rows: dict[str, LayerKV]):
        # Rows to keep: a few index_selects per layer; no per-row copies.
        kept_layers: LayerKV = []
        kept_mask = None
        if old is not None and keep_ids:
            pos = {rid: i for i, rid in enumerate(old.ids)}
            idx = torch.tensor([pos[r] for r in keep_ids], device=old.mask.device)
            kept_mask = old.mask.index_select(0, idx)
            kept_layers = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in cache_layers(old.cache)]
        new_lens = [kv[0][0].shape[2] for kv in new_rows.values()]
        kept_len = int(kept_mask.sum(1).max()) if kept_mask is not None else 0
        # The new width: the longest row. Columns that are padding in every row are dropped.
        width = max([kept_len, *new_lens])
        n_layers = len(kept_layers) or len(next(iter(new_rows.values())))
        keys: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        values: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        masks: list[torch.Tensor] = []
        if kept_mask is not None:
            masks.append(_fit_left(kept_mask, width, dim=1))
            for layer, (k, v) in enumerate(kept_layers):
                keys[layer].append(_fit_left(k, width, dim=2))
                values[layer].append(_fit_left(v, width, dim=2))
        for kv, n in zip(new_rows.values(), new_lens):
            masks.append(_fit_left(torch.ones(1, n, dtype=torch.long, device=kv[0][0].device), width, dim=1))
            for layer, (k, v) in enumerate(kv):
                keys[layer].append(_fit_left(k, width, dim=2))
                values[layer].append(_fit_left(v, width, dim=2))
        layers = [(torch.cat(ks, 0), torch.cat(vs, 0)) for ks, vs in zip(keys, values)]
        return PaddedKVBatch(config, layers, torch.cat(masks, 0), [*keep_ids, *new_rows])


def _fit_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Left-pad ``t`` with zeros, or drop leading entries, so ``t.shape[dim] == length``."""
    have = t.shape[dim]
    if have == length:
        return t
    if have > length:
        return t.narrow(dim, have - length, length)
    pad = [0, 0] * (t.dim() - 1 - dim) + [length - have, 0]
    return F.pad(t, pad)
