"""One generation that survives partial rollout's truncations: a plain response, or one agent turn.

`generate_resumable` sends a request through the group's `GroupCalls`; when a round's end
truncates it, what it generated is kept in its `PartialResponse`, it waits in the Rollouter's
partial buffer for the next round, and it goes again as prompt + partial with the budget left
(``make_request(parts)`` builds each try). Both the Rollouter's single-turn responses and the
agent loops' turns (`asyncrl.rollouter.agents`) run through it, so truncation means the same
thing for both.

It works against `Rounds`, the round state the Rollouter owns and moves (the weight version, the
round's end), never against the Rollouter itself, and writes into the generation's record
(`asyncrl.rollouter.response`): its parts, its status, and (through `GroupCalls`) the replica
each request goes to. A single-turn `Response` is ``checkpointed``: a truncation puts it in
`Rounds.truncated` (a checkpoint saves its parts, so that a resume continues the response from
them). An agent turn's `Conversation` is not: a conversation in flight at a crash is generated
again from its start, which keeps exactly once without saving tool state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.rollouter.partial import PartialBuffer, PartialResponse
from asyncrl.rollouter.pool import GroupCalls
from asyncrl.rollouter.response import Conversation, Response
from asyncrl.rollouter.stats import RolloutStats
from asyncrl.types import GenerateRequest, GenerateResult


@dataclass(eq=False)
class Rounds:
    """Partial rollout's rounds as a resumable generation reads and writes them. The Rollouter owns
    one (`Rollouter.rounds`): it sets ``version`` at each weight sync and ``closed`` when the
    aggregator says the round's step has its groups."""

    partials: PartialBuffer
    """Where a truncated response waits for the next round."""
    stats: RolloutStats
    """Counts ``truncated`` and ``resumed`` responses."""
    max_age: int = 0
    """Truncations a response may survive; 0: rounds truncate nothing (no aggregator)."""
    truncated: dict[str, dict[int, Response]] = field(default_factory=dict)
    """Truncated responses not yet finished, of groups not yet sent (``sample_id -> {k: record}``):
    a checkpoint saves their parts."""
    version: int = 0
    """The weight version the engines serve (the round)."""
    closed: bool = False
    """The round ended: nothing truncatable goes out until the next sync."""


async def generate_resumable(r: Rounds, calls: GroupCalls, make_request: Callable[[PartialResponse], GenerateRequest],
                             record: Response | Conversation, budget: int, *,
                             resuming: bool = False) -> tuple[GenerateResult, int]:
    """Generate into ``record.parts`` until it ends or holds ``budget`` tokens; the last result and its replica.

    ``resuming``: the parts came from a checkpoint (its first dispatch counts as a resume)."""
    parts = record.parts
    owed = False  # released by the partial buffer (counted undispatched there) and not yet dispatched
    while True:
        truncatable = parts.age < r.max_age
        if truncatable and r.closed:
            # The round ended before this went out (its engines idle until the sync): wait for the next.
            if owed:
                r.partials.dispatched()
            await r.partials.wait(parts.age, r.version)
            owed = True
            continue
        request = make_request(parts)
        if owed:
            r.partials.dispatched()
            owed = False
        if resuming:
            r.stats.resumed += 1
            resuming = False
        dispatched_in = r.version
        record.status = "running"
        result, replica = await calls.generate(request, truncatable, record)
        parts.add(result)
        if result.finish_reason != "truncated" or parts.n_tokens >= budget:
            return result, replica
        if len(result.response_ids):  # stopped with tokens: one more truncation survived
            parts.age += 1
            r.stats.truncated += 1
            record.status = "truncated"
            if record.checkpointed:
                r.truncated.setdefault(record.sample_id, {})[record.k] = record
            resuming = True
        # (Stopped before its first token, by the synchronous workflow's round end: it waits
        # for the next round as it was.) The round it was stopped in: never later than its
        # last token's version or the round it was sent in (a later guess could wait for a
        # sync that needs this group).
        stopped_in = int(result.versions[-1]) if len(result.versions) else dispatched_in
        if stopped_in >= r.version:
            await r.partials.wait(parts.age, stopped_in)
        else:
            r.partials.undispatched += 1  # its next round has begun already: go now
        owed = True
