"""The model side of the built-in engine: one step = one forward over every running request.

`ModelRunner` owns the paged KV cache (`asyncrl.rollouter.engines.builtin.kv_cache`), the forward and the
sampler. In a step, every request in decode state feeds its last token and every newly
admitted one (or one re-prefilled after ``clear_cache``) feeds its whole prompt; the queries
are right-padded to the longest and run in ONE forward with a 4-d mask and per-row
positions, so admitting a request costs no extra forward. When that padding would be large
(a long prompt beside short decodes: more than ``PAD_BUDGET`` padded query tokens), the
decode rows run in one forward and each prompt in its own, unpadded.

The ``n`` responses of a group share one prefill. Requests admitted in the same step with
the same tokens: the first runs the prompt, the others take its blocks (shared, copied on
write) and sample their first token, each with its own seed, from its logits. A request
admitted later, while a request with its prompt still runs and the weights are the same
version: it takes that request's blocks for all but the prompt's last token and feeds only
that one. A turn of a conversation (``session_id``) whose earlier turn's blocks are kept
(`asyncrl.rollouter.engines.builtin.sessions`) adopts them and feeds only the tokens past them,
among the prompts; a finished turn hands its blocks to the session (`keep`).

The forward is `asyncrl.rollouter.engines.builtin.decoder.LlamaDecoder` for Llama-layout models, else the
model's own ``forward``. `run_steps` runs steps (`plan`: bookkeeping, `forward`) back to back in
the engine's worker thread, while the engine's scheduler holds its lock. Scheduling (who runs, pauses, finishing) is in
`asyncrl.rollouter.engines.builtin.engine`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncrl.rollouter.engines.builtin.decoder import LlamaDecoder
from asyncrl.rollouter.engines.builtin.kv_cache import PagedKVCache, step_masks
from asyncrl.rollouter.engines.builtin.sampling import sample_tokens
from asyncrl.rollouter.engines.builtin.sessions import SessionKV
from asyncrl.types import GenerateRequest, GenerateResult


@dataclass(eq=False)
class Sequence:
    """One request inside the engine: its tokens so far, log-probs, versions and KV blocks."""

    request: GenerateRequest
    future: asyncio.Future
    tokens: list[int]
    """Prompt + generated tokens; in decode state the last one is not in the KV cache yet."""
    stop_ids: frozenset[int]
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    """Its block table in the paged KV cache."""
    cached: int = 0
    """Tokens whose keys/values are in its blocks (0 until its prompt is prefilled, and after a
    ``clear_cache``)."""
    prefilled: int = 0
    """Prompt tokens computed for it (its part of the engine's ``prefill_tokens``)."""
    stale_kv: bool = False
    """Its cache holds keys/values of weights replaced since (it was paused with ``keep`` across a
    weight update): not kept for its session's next turn."""

    @property
    def rid(self) -> str:
        return self.request.request_id

    @property
    def needs_prefill(self) -> bool:
        return self.cached == 0

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
            prefill_tokens=self.prefilled,
        )


@dataclass
class StepPlan:
    """What one step runs: ``rows`` in the forward (decode rows first), then ``followers`` that
    sample from the logits of row ``sources[i]``; ``order`` = rows + followers."""

    rows: list[Sequence]
    pending: list[list[int]]
    starts: list[int]
    n_decode: int
    followers: list[Sequence]
    sources: list[int]
    prefill_tokens: int
    """Prompt tokens this step computes (shared prompts once)."""
    shared_tokens: int
    """Prompt tokens this step's new requests took from another request's prefill."""

    @property
    def order(self) -> list[Sequence]:
        return self.rows + self.followers


#: Most padded (wasted) query tokens a step may spend to run prompts and decodes in one forward.
PAD_BUDGET = 256


class ModelRunner:
    """Runs the model for the scheduler: the paged KV cache, the forward, the sampler."""

    def __init__(self, model, device: str, seed: int, decoder: str = "auto", session_idle_s: float = 60.0,
                 session_max_blocks: int = 2048) -> None:
        self.model = model
        self.device = device
        self.generator = torch.Generator().manual_seed(seed)
        """Sampler of the requests that carry no seed of their own."""
        self.cache = PagedKVCache(device)
        self.decoder = LlamaDecoder(model) if decoder == "auto" and LlamaDecoder.supports(model) else None
        """The lean forward, or None: the model's own ``forward``."""
        self.held: list[Sequence] = []
        """The requests holding KV blocks."""
        self.donors: dict[tuple[int, ...], tuple[Sequence, int]] = {}
        """Prompt -> (a running request that prefilled it, the weight version it did so under)."""
        self.peak_tokens = 0
        """Most tokens the running requests had cached at once (shared prompt tokens counted per request)."""
        self.sessions = SessionKV(self.cache, session_idle_s, session_max_blocks)
        """Finished turns' blocks kept for their conversation's next turn."""

    def drop_kv(self) -> None:
        """Forget every request's cache (they re-prefill from their tokens)."""
        for seq in self.held:
            seq.blocks, seq.cached, seq.stale_kv = [], 0, False
        self.held = []
        self.donors.clear()
        self.sessions.clear()
        self.cache.clear()

    def keep(self, seq: Sequence, version: int) -> None:
        """``seq``, a turn of a session, ended: keep its blocks for the session's next turn (not when
        its cache outlived a weight update)."""
        if seq.cached and not seq.stale_kv:
            self.sessions.keep(seq.request.session_id, seq.blocks, seq.tokens[: seq.cached], version)
            seq.blocks = []  # the session holds them now

    def weights_changed(self) -> None:
        """The weights changed: kept turns are stale, and so is every running request's cache."""
        for seq in self.held:
            seq.stale_kv = seq.stale_kv or seq.cached > 0
        self.sessions.clear()

    def _resume(self, seq: Sequence, version: int) -> bool:
        """Give ``seq`` its session's kept blocks where they hold the start of its prompt."""
        kept = self.sessions.take(seq.request.session_id, seq.tokens, version)
        if kept is None:
            return False
        seq.blocks, seq.cached = kept
        return True

    @torch.inference_mode()
    def plan(self, running: list[Sequence], version: int) -> StepPlan:
        """Blocks and rows for a step over ``running`` under weights ``version``; frees the
        blocks of requests gone since."""
        live = {id(s) for s in running}
        for seq in self.held:
            if id(seq) not in live:
                self.cache.release(seq.blocks)
        self.held = list(running)
        self.donors = {k: d for k, d in self.donors.items() if id(d[0]) in live and d[1] == version}
        leaders: dict[tuple[int, ...], int] = {}
        decode, prefill, followers, lead_of, resumed = [], [], [], [], []
        taken, fed = 0, 0  # prompt tokens taken from running requests; requests fed that way
        for seq in running:
            if not seq.needs_prefill:
                decode.append(seq)
                continue
            if seq.request.session_id is not None and not seq.n_generated and self._resume(seq, version):
                resumed.append(seq)  # its conversation's earlier turns are cached: it feeds the rest
                continue
            key = tuple(seq.tokens)
            if key in leaders:
                followers.append(seq)
                lead_of.append(leaders[key])
            elif key in self.donors and len(key) > 1:  # all but the last prompt token from a running request
                donor = self.donors[key][0]
                seq.blocks = self.cache.fork(donor.blocks[: -(-(len(key) - 1) // self.cache.block_tokens)])
                seq.cached = len(key) - 1
                taken, fed = taken + seq.cached, fed + 1
                decode.append(seq)
            else:
                leaders[key] = len(prefill)
                prefill.append(seq)
                if not seq.n_generated:
                    self.donors[key] = (seq, version)
        rows = decode + prefill + resumed
        pending = [s.tokens[s.cached :] for s in rows]
        for seq, p in zip(rows, pending):
            if seq.needs_prefill or not seq.n_generated:  # a prompt (or one re-read after clear_cache); fed: 1 token
                seq.prefilled += len(p)
        starts = [s.cached for s in rows]
        for seq, p in zip(rows, pending):
            self.cache.allocate(seq.blocks, seq.cached, seq.cached + len(p))
            seq.cached += len(p)
        for seq, lead in zip(followers, lead_of):
            leader = prefill[lead]
            seq.blocks, seq.cached = self.cache.fork(leader.blocks), leader.cached
        self.peak_tokens = max(self.peak_tokens, sum(s.cached for s in running))
        # Prompts run whole (a resumed turn: past its kept tokens), plus the last prompt token of each
        # request fed from a running one.
        prefill_tokens = sum(len(p) for p in pending[len(decode):]) + fed
        return StepPlan(rows, pending, starts, len(decode), followers, [len(decode) + i for i in lead_of],
                        prefill_tokens=prefill_tokens, shared_tokens=taken + sum(s.cached for s in followers))

    def run_steps(self, running: list[Sequence], version: int, max_len: int, counters: dict[str, int],
                  hand_back: Callable[[], object]) -> list[tuple[Sequence, str]]:
        """Steps over ``running``, back to back (in the engine's worker thread), until a request
        ends (stop token, ``max_tokens``, ``max_len``) or its caller cancelled, or ``hand_back()``
        (a caller waits for the engine's lock, or it closed); the ended requests with their finish
        reasons. Each step appends a token, log-prob and version to every request and counts
        into ``counters``.

        One thread hop per run of steps instead of per step: on a busy machine each wake of the
        worker and then of the event loop can wait for a time slice. Nothing else touches the
        requests or the runner meanwhile: every change to them takes the engine's lock, which its
        scheduler holds (``progress`` and ``stats`` only read)."""
        ended: list[tuple[Sequence, str]] = []
        while True:
            if self.sessions:
                self.sessions.expire()
            plan = self.plan(running, version)
            tokens, logprobs = self.forward(plan)
            counters["steps"] += 1
            counters["prefill_tokens"] += plan.prefill_tokens
            counters["shared_prefill_tokens"] += plan.shared_tokens
            counters["tokens_generated"] += len(plan.order)
            for seq, tok, lp in zip(plan.order, tokens.tolist(), logprobs.tolist()):
                seq.tokens.append(tok)
                seq.logprobs.append(lp)
                seq.versions.append(version)
                if tok in seq.stop_ids:
                    ended.append((seq, "stop"))
                elif len(seq.logprobs) >= seq.request.max_tokens or len(seq.tokens) >= max_len:
                    ended.append((seq, "length"))
            if ended or hand_back() or any(s.future.done() for s in running):
                return ended

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step's forward(s); sample one token per request of ``plan.order``."""
        rows, pending, n_decode = plan.rows, plan.pending, plan.n_decode
        real = sum(len(p) for p in pending)
        longest = max(len(p) for p in pending)
        if len(rows) * longest - real <= PAD_BUDGET:
            groups = [(0, len(rows))]
        else:  # decode rows together, each prompt on its own
            groups = ([(0, n_decode)] if n_decode else []) + [(r, r + 1) for r in range(n_decode, len(rows))]
        logits = [self._forward_rows(rows, pending, lo, hi, plan.starts) for lo, hi in groups]
        logits = logits[0] if len(logits) == 1 else torch.cat(logits)
        if plan.followers:
            logits = torch.cat([logits, logits[plan.sources]])
        order = plan.order
        return sample_tokens(logits, [s.request.sampling for s in order], [s.n_generated for s in order],
                             self.generator)

    def _forward_rows(self, rows: list[Sequence], pending: list[list[int]], lo: int, hi: int,
                      starts: list[int]) -> torch.Tensor:
        """One forward over ``rows[lo:hi]``; the logits after each row's last real token."""
        device = self.device
        starts = np.asarray(starts[lo:hi], dtype=np.int64)
        lens = np.fromiter((len(p) for p in pending[lo:hi]), dtype=np.int64, count=hi - lo)
        width_q = int(lens.max())
        self.cache.begin([s.blocks for s in rows[lo:hi]], starts, lens, width_q)
        # Ids, columns and positions in numpy (a few small ops, each far cheaper than a torch op).
        # Row r's query i is at column start + i; padded queries write to scratch and their
        # outputs are dropped (each real query's mask stops at its own column).
        if width_q == 1:  # decode: one token per row, at column `start`
            ids = np.fromiter((p[0] for p in pending[lo:hi]), dtype=np.int64, count=hi - lo)[:, None]
            cols = positions = starts[:, None]
        else:
            ids = np.zeros((hi - lo, width_q), dtype=np.int64)
            for r, p in enumerate(pending[lo:hi]):
                ids[r, : len(p)] = p
            cols = starts[:, None] + np.arange(width_q)
            # Padded queries reuse their row's last real position (a learned position table stays in range).
            positions = np.minimum(cols, (starts + lens - 1)[:, None])
        width = int((starts + lens).max())
        mask = step_masks(self.model.config, cols, width, device)
        ids, positions, last = (torch.from_numpy(a).to(device) for a in (ids, positions, lens - 1))
        if self.decoder is not None:
            return self.decoder(ids, positions, mask, self.cache, last)
        # Logits only from the shortest row's last token on (an int logits_to_keep means the same
        # in every transformers 5.x; a tensor of positions does not), then each row's own last one.
        keep = width_q - int(lens.min()) + 1
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=keep)
        if keep == 1:
            return out.logits[:, -1]
        return out.logits[torch.arange(hi - lo, device=device), last - (width_q - keep)]
