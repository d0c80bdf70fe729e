"""The model side of the built-in engine: one step = prefill new requests + one batched decode.

`ModelRunner` owns the model's stacked decode cache (`asyncrl.rollouter.kv_batch`) and the
sampler. A newly admitted request is prefilled on its own (no padding: its prompt forward is
exactly ``model.generate``'s) and gets its first token; every other running request is
decoded in ONE forward over the left-padded stack of their KV caches, with per-row position
ids. `forward` runs in a worker thread; `sync_batch` and the bookkeeping run on the engine's
event loop between steps. Scheduling (who runs, pauses, finishing) is in `torch_engine`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncrl.rollouter.kv_batch import LayerKV, PaddedKVBatch, cache_layers
from asyncrl.rollouter.sampling import sample_tokens
from asyncrl.types import GenerateRequest, GenerateResult


@dataclass(eq=False)
class Sequence:
    """One request inside the engine: its tokens so far, log-probs, versions and cache state."""

    request: GenerateRequest
    future: asyncio.Future
    tokens: list[int]
    """Prompt + generated tokens; in decode state the last one is not in the KV cache yet."""
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv: LayerKV | None = None
    """Own cache after a prefill, until the request joins the batched decode cache."""
    needs_prefill: bool = True

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def n_generated(self) -> int:
        return len(self.logprobs)

    def result(self, finish_reason: str) -> GenerateResult:
        n = self.n_generated
        return GenerateResult(
            request_id=self.rid,
            response_ids=np.asarray(self.tokens[len(self.tokens) - n :], dtype=np.int64),
            logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int64),
            finish_reason=finish_reason,
        )


class ModelRunner:
    """Runs the model for the scheduler: the decode batch's cache, the forward, the sampler."""

    def __init__(self, model, device: str, seed: int) -> None:
        self.model = model
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)
        """Sampler of the requests that carry no seed of their own."""
        self.batch: PaddedKVBatch | None = None

    def drop_kv(self) -> None:
        self.batch = None

    def sync_batch(self, decode: list[Sequence]) -> None:
        """Make the stacked decode cache hold exactly ``decode`` (in that order)."""
        ids = [s.rid for s in decode]
        if self.batch is not None and self.batch.ids == ids:
            return
        if not decode:
            self.batch = None
            return
        old_ids = set(self.batch.ids) if self.batch is not None else set()
        keep = [s.rid for s in decode if s.rid in old_ids]
        new = {s.rid: s.kv for s in decode if s.rid not in old_ids}
        for s in decode:
            s.kv = None  # the batch owns it now
        if self.batch is None or not keep:
            self.batch = PaddedKVBatch.build(self.model.config, new)
        else:
            self.batch = self.batch.rebuilt(keep, new)
        # Reorder the decode list to the batch's row order.
        order = {rid: i for i, rid in enumerate(self.batch.ids)}
        decode.sort(key=lambda s: order[s.rid])

    @torch.no_grad()
    def forward(self, prefill: list[Sequence], decode: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill each new request, decode the batch; sample one token per request."""
        from transformers import DynamicCache

        device = self.device
        rows = []
        for seq in prefill:
            cache = DynamicCache(config=self.model.config)
            ids = torch.tensor([seq.tokens], dtype=torch.long, device=device)
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            seq.kv = cache_layers(cache)
            rows.append(out.logits[0, -1])
        if decode:
            batch = self.batch
            pending = torch.tensor([[s.tokens[-1]] for s in decode], dtype=torch.long, device=device)
            positions = torch.tensor([[len(s.tokens) - 1] for s in decode], dtype=torch.long, device=device)
            mask = batch.step_inputs()
            out = self.model(
                input_ids=pending,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=batch.cache,
                use_cache=True,
            )
            batch.advanced(mask)
            rows.extend(out.logits[:, -1])
        seqs = [*prefill, *decode]
        return sample_tokens(
            torch.stack(rows),
            [s.request.sampling for s in seqs],
            [s.generator for s in seqs],
            self.generator,
        )

