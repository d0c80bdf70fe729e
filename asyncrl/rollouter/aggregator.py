"""``AggregatorActor``: counts finished trajectories across every engine replica and ends a round.

A round is the span between two weight syncs; its number is the weight version. Rollouters
report each finished group here (`report`), split by the replica that finished each
trajectory. When the round's count reaches ``threshold`` the aggregator signals every
replica (``truncate(version)`` on each `asyncrl.rollouter.actor.EngineActor`) to stop the
round's unfinished, truncatable requests that have generated tokens (queued ones run on in
the freed slots); each returns its partial output with ``finish_reason="truncated"`` and
the Rollouter parks it in its partial buffer.

What is counted: the trajectories of *complete* groups, ``n`` per group. A finished
trajectory whose siblings are still running gives the Trainer nothing, so counting it could
end a round before the Trainer has ``groups_per_sync`` groups; the truncated responses would
then wait for a weight sync that never comes. Counted this way, the default threshold
(``groups_per_sync * n``) ends a round exactly when the Trainer has what it needs.

The class is plain Python (usable in-process); `remote_aggregator_actor` makes the Ray actor.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("asyncrl.rollouter.aggregator")


class AggregatorActor:
    """Counts completions per round across ``engines`` and truncates at ``threshold``."""

    def __init__(self, engines: Sequence[Any], threshold: int, *, signal_timeout_s: float = 60.0):
        if threshold < 1:
            raise ValueError(f"AggregatorActor threshold must be >= 1, got {threshold}")
        if not engines:
            raise ValueError("AggregatorActor needs the engine replicas it signals")
        self.engines = list(engines)
        self.threshold = threshold
        self.signal_timeout_s = signal_timeout_s
        self.round = 0
        self.count = 0
        self.per_replica: dict[int, int] = {}
        self.truncated_rounds: dict[int, int] = {}
        """round -> requests stopped by its truncation signal."""
        self.signalled = False

    async def start_round(self, version: int) -> None:
        """Weight version ``version`` is live: a new round with a fresh count."""
        if version > self.round:
            self.round, self.count, self.per_replica, self.signalled = version, 0, {}, False

    async def report(self, version: int, per_replica: Mapping[int, int]) -> bool:
        """A group finished in round ``version``; ``per_replica``: replica -> trajectories it
        finished. Returns True when this report ended the round (the replicas were signalled)."""
        await self.start_round(version)
        if version < self.round:
            return False  # a late report of a round already over
        for replica, k in per_replica.items():
            self.per_replica[int(replica)] = self.per_replica.get(int(replica), 0) + int(k)
            self.count += int(k)
        if self.signalled or self.count < self.threshold:
            return False
        self.signalled = True
        self.truncated_rounds[version] = await self._signal(version)
        return True

    async def _signal(self, version: int) -> int:
        """``truncate(version)`` on every replica; a dead or stuck replica is logged, not waited for."""
        calls = [asyncio.wait_for(_invoke(e, "truncate", version), self.signal_timeout_s) for e in self.engines]
        stopped = 0
        for i, out in enumerate(await asyncio.gather(*calls, return_exceptions=True)):
            if isinstance(out, BaseException):
                log.warning("aggregator: replica %d did not take the truncation of round %d: %r", i, version, out)
            else:
                stopped += int(out)
        return stopped

    async def stats(self) -> dict:
        return {"round": self.round, "count": self.count, "threshold": self.threshold,
                "per_replica": dict(self.per_replica), "truncated_rounds": dict(self.truncated_rounds)}


async def _invoke(target: Any, method: str, *args: Any) -> Any:
    """Call ``target.method(*args)`` on a Ray actor handle or an in-process object."""
    fn = getattr(target, method)
    remote = getattr(fn, "remote", None)
    out = remote(*args) if remote is not None else fn(*args)
    return await out if inspect.isawaitable(out) else out


def remote_aggregator_actor(**options):
    """The Ray actor class: ``remote_aggregator_actor().remote(engines, threshold)``."""
    import ray

    return ray.remote(num_cpus=0, **options)(AggregatorActor)
