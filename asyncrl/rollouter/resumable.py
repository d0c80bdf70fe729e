"""One generation that survives partial rollout's truncations: a plain response, or one agent turn.

`generate_resumable` sends a request through the group's `GroupCalls`; when a round's end
truncates it, what it generated is kept in its `PartialResponse`, it waits in the Rollouter's
partial buffer for the next round, and it goes again as prompt + partial with the budget left
(``make_request(parts)`` builds each try). Both the Rollouter's single-turn responses and the
agent loops' turns (`asyncrl.rollouter.agents`) run through it, so truncation means the same
thing for both.

``keep`` names the response in the Rollouter's ``_truncated`` (what a checkpoint saves, so that a
resume continues the response from its parts); agent turns pass None: a conversation in flight at
a crash is generated again from its start, which keeps exactly once without saving tool state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from asyncrl.rollouter.partial import PartialResponse
from asyncrl.rollouter.pool import GroupCalls
from asyncrl.types import GenerateRequest, GenerateResult

if TYPE_CHECKING:
    from asyncrl.rollouter.rollouter import Rollouter


async def generate_resumable(r: Rollouter, calls: GroupCalls, make_request: Callable[[PartialResponse], GenerateRequest],
                             parts: PartialResponse, budget: int, *, resuming: bool = False,
                             keep: tuple[str, int] | None = None) -> tuple[GenerateResult, int]:
    """Generate into ``parts`` until it ends or holds ``budget`` tokens; the last result and its replica.

    ``resuming``: ``parts`` came from a checkpoint (its first dispatch counts as a resume)."""
    owed = False  # released by the partial buffer (counted undispatched there) and not yet dispatched
    while True:
        truncatable = r.aggregator is not None and parts.age < r.partial.max_age
        if truncatable and r._round_closed:
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
        result, replica = await calls.generate(request, truncatable)
        parts.add(result)
        if result.finish_reason != "truncated" or parts.n_tokens >= budget:
            return result, replica
        if len(result.response_ids):  # stopped with tokens: one more truncation survived
            parts.age += 1
            r.stats.truncated += 1
            if keep is not None:
                r._truncated.setdefault(keep[0], {})[keep[1]] = parts
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
