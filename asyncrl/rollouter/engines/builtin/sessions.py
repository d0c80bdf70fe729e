"""A conversation's KV kept between its turns (``GenerateRequest.session_id``), for the built-in engine.

Each turn of an agent loop is a new request whose prompt is the whole conversation so far. When
a turn with a session id ends (``stop`` or ``length``), `SessionKV.keep` holds its block table
under the session id with the exact tokens those blocks hold (prompt + generated tokens, less the
last sampled one: no forward has written its keys and values yet) and the weight version. When
the session's next turn is planned, `SessionKV.take` hands the table over (the turn adopts it, no
copy) if the weights are the same and its prompt starts with the kept tokens; the turn then
prefills only the rest. Otherwise the entry is released and the turn prefills in full. Both checks
are what makes reuse exact: keys and values from other weights give other log-probs, and a prompt
that does not extend the kept tokens would attend to tokens it does not have.

An entry is freed by `end`, by any change of the weights (`clear`: a load, direct writes, a new
version), by ``pause(clear_cache=True)`` and close, after ``idle_s`` without a turn (`expire`,
run by the scheduler before each step: the pools never shrink, so a block only matters when a
step needs it), and least recently used first while the entries together hold more than
``max_blocks`` blocks (a block shared by several sessions, as a group's prompt, is counted once
per session). A turn whose own KV lived through a weight update (paused with ``keep`` across a
sync) is never kept: its blocks mix two versions (the engine checks that).

Bookkeeping only, on the engine's event loop between steps, like the cache's ``allocate``/``release``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from asyncrl.rollouter.engines.builtin.kv_cache import PagedKVCache

COUNTERS = ("session_kept", "session_hits", "session_tokens_reused", "session_misses", "session_evicted",
            "session_dropped")
"""``stats()`` counters: turns kept; turns that reused a kept turn's KV, and the prompt tokens they
did not prefill; kept turns released unused because the next turn's prompt did not extend them or the
version differed (misses), for the budget or the idle timeout (evicted), or at a weight change or a
cleared cache (dropped)."""


@dataclass(eq=False)
class KeptTurn:
    blocks: list[int]
    """The block table; block ``j // block_tokens`` holds token ``j`` of ``tokens``."""
    tokens: list[int]
    """The tokens whose keys and values the blocks hold."""
    version: int
    """The weight version they were computed under."""
    since: float
    """When the turn was kept (the clock of `SessionKV`)."""


class SessionKV:
    """The kept turns of a replica's conversations (see the module docstring)."""

    def __init__(self, cache: PagedKVCache, idle_s: float, max_blocks: int, clock=time.monotonic) -> None:
        self.cache = cache
        self.idle_s = idle_s
        self.max_blocks = max_blocks
        self.clock = clock
        self._kept: OrderedDict[str, KeptTurn] = OrderedDict()  # least recently kept first
        self.blocks = 0
        """Blocks the entries hold together (a shared block once per entry)."""
        self.counters = dict.fromkeys(COUNTERS, 0)

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, session_id: str, blocks: list[int], tokens: list[int], version: int) -> None:
        """Hold a finished turn's ``blocks`` (the caller gives up its hold) for ``tokens``."""
        self._release(session_id)  # an older turn of the session, ended after this one began
        n_blocks = -(-len(tokens) // self.cache.block_tokens)
        self.cache.release(blocks[n_blocks:])
        del blocks[n_blocks:]
        if not tokens or n_blocks > self.max_blocks:
            self.cache.release(blocks)
            self.counters["session_evicted"] += bool(tokens)
            return
        self._kept[session_id] = KeptTurn(blocks, tokens, version, self.clock())
        self.blocks += n_blocks
        self.counters["session_kept"] += 1
        while self.blocks > self.max_blocks:
            self._release(next(iter(self._kept)), "session_evicted")

    def take(self, session_id: str, prompt: list[int], version: int) -> tuple[list[int], int] | None:
        """The kept table of ``session_id`` and how many of ``prompt``'s tokens it holds, for a turn
        under weights ``version`` (the entry leaves the store); None when there is none to use (an
        entry that does not fit is released)."""
        entry = self._kept.pop(session_id, None)
        if entry is None:
            return None
        self.blocks -= len(entry.blocks)
        n = len(entry.tokens)
        # At least the prompt's last token is fed: its logits sample the turn's first token.
        reused = min(n, len(prompt) - 1)
        if entry.version != version or reused < 1 or prompt[:n] != entry.tokens:
            self.cache.release(entry.blocks)
            self.counters["session_misses"] += 1
            return None
        self.counters["session_hits"] += 1
        self.counters["session_tokens_reused"] += reused
        return entry.blocks, reused

    def end(self, session_id: str) -> None:
        """The conversation ended: free its kept turn, if any."""
        self._release(session_id)

    def expire(self) -> None:
        """Free the turns kept longer than ``idle_s`` ago."""
        deadline = self.clock() - self.idle_s
        while self._kept and next(iter(self._kept.values())).since < deadline:
            self._release(next(iter(self._kept)), "session_evicted")

    def clear(self) -> None:
        """Free every kept turn (the weights changed, or the cache is about to be cleared)."""
        while self._kept:
            self._release(next(iter(self._kept)), "session_dropped")

    def _release(self, session_id: str, counter: str | None = None) -> None:
        entry = self._kept.pop(session_id, None)
        if entry is not None:
            self.blocks -= len(entry.blocks)
            self.cache.release(entry.blocks)
            if counter:
                self.counters[counter] += 1
