"""The model side of the built-in engine: one step = one forward over every running request.

`ModelRunner` owns the slot KV cache (`asyncrl.rollouter.kv_batch`) and the sampler. Each
running request holds one cache row. In a step, every request in decode state feeds its
last token and every newly admitted one (or one re-prefilled after ``clear_cache``) feeds its
whole prompt; the queries are right-padded to the longest and run in ONE forward with a
4-d mask and per-row positions, so admitting a request costs no extra forward. When that
padding would be large (a long prompt beside short decodes: more than ``PAD_BUDGET`` padded
query tokens), the decode rows run in one forward and each prompt in its own, unpadded.

`forward` runs in a worker thread; `plan` (row bookkeeping) runs on the engine's event loop
between steps. Scheduling (who runs, pauses, finishing) is in `torch_engine`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncrl.rollouter.kv_batch import SlotKVCache, step_masks
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
    needs_prefill: bool = True
    """True until its prompt (+ tokens generated before a ``clear_cache``) is in the KV cache."""

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def cached(self) -> int:
        """Tokens in its KV cache row (all but the last token, in decode state)."""
        return 0 if self.needs_prefill else len(self.tokens) - 1

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


#: Most padded (wasted) query tokens a step may spend to run prompts and decodes in one forward.
PAD_BUDGET = 256


class ModelRunner:
    """Runs the model for the scheduler: the slot KV cache, the forward, the sampler."""

    def __init__(self, model, device: str, seed: int, n_slots: int) -> None:
        self.model = model
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)
        """Sampler of the requests that carry no seed of their own."""
        self.cache = SlotKVCache(n_slots, device)
        self.rows: list[Sequence] = []
        """The requests holding cache rows 0..len-1, in row order."""
        self.peak_tokens = 0
        """Most tokens the cache held after one step."""

    def drop_kv(self) -> None:
        self.cache.clear()
        self.rows = []

    @torch.inference_mode()
    def plan(self, decode: list[Sequence], prefill: list[Sequence]) -> list[Sequence]:
        """Give every request of this step its row; returns them in row order, decode rows first.

        Requests that left since the last step (finished, aborted, cancelled) free their
        rows: the last row moves into each hole, so the rows in use stay ``0..n-1``.
        """
        live = {id(s) for s in decode}
        rows = self.rows
        while rows and id(rows[-1]) not in live:
            rows.pop()
        for i, seq in enumerate(rows):
            if id(seq) not in live:
                last = rows.pop()
                self.cache.move_row(len(rows), i, last.cached)
                rows[i] = last
                while rows and id(rows[-1]) not in live:
                    rows.pop()
        if len(rows) != len(decode):
            raise RuntimeError(f"KV rows out of sync: {len(rows)} rows for {len(decode)} decoding requests")
        rows.extend(prefill)
        return list(rows)

    @torch.inference_mode()
    def forward(self, rows: list[Sequence], n_decode: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step for ``rows`` (as ordered by `plan`); sample one token per row."""
        pending = [s.tokens[s.cached :] for s in rows]
        real = sum(len(p) for p in pending)
        longest = max(len(p) for p in pending)
        if len(rows) * longest - real <= PAD_BUDGET:
            groups = [(0, len(rows))]
        else:  # decode rows together, each prompt on its own
            groups = ([(0, n_decode)] if n_decode else []) + [(r, r + 1) for r in range(n_decode, len(rows))]
        logits = [self._forward_rows(rows, pending, lo, hi) for lo, hi in groups]
        self.peak_tokens = max(self.peak_tokens, sum(s.cached + len(p) for s, p in zip(rows, pending)))
        return sample_tokens(
            logits[0] if len(logits) == 1 else torch.cat(logits),
            [s.request.sampling for s in rows],
            [s.generator for s in rows],
            self.generator,
        )

    def _forward_rows(self, rows: list[Sequence], pending: list[list[int]], lo: int, hi: int) -> torch.Tensor:
        """One forward over cache rows ``lo..hi-1``; the logits after each row's last real token."""
        device = self.device
        starts = [rows[r].cached for r in range(lo, hi)]
        lens = [len(pending[r]) for r in range(lo, hi)]
        width_q = max(lens)
        ids = torch.tensor([p + [0] * (width_q - len(p)) for p in pending[lo:hi]], dtype=torch.long, device=device)
        # Row r's query i goes to cache column start + i; padded queries write past the row's
        # end (overwritten by its next tokens, never read: the mask stops at each query's column).
        cols = torch.tensor(starts, device=device)[:, None] + torch.arange(width_q, device=device)
        width = max(s + n for s, n in zip(starts, lens))
        self.cache.begin(lo, hi, cols, width)
        last = torch.tensor(lens, device=device)[:, None] - 1
        # Padded queries reuse their row's last real position (a learned position table stays in range).
        positions = torch.minimum(cols, cols.gather(1, last)) if width_q > 1 else cols
        # Logits only from the shortest row's last token on (an int logits_to_keep means the same
        # in every transformers 5.x; a tensor of positions does not), then each row's own last one.
        keep = width_q - min(lens) + 1
        out = self.model(
            input_ids=ids,
            attention_mask=step_masks(self.model.config, cols, width),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        if keep == 1:
            return out.logits[:, -1]
        return out.logits[torch.arange(hi - lo, device=device), last[:, 0] - (width_q - keep)]
