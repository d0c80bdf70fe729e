"""``AggregatorActor``: counts finished trajectories across every engine replica and ends a round.

A round is the span between two weight syncs; its number is the weight version. In the RFC's
synchronous workflow (``mode=sync``, `asyncrl.rollouter.partial`) the Rollouter reports each
finished group here (`report`), split by the replica that finished each trajectory; when the
round's count reaches its threshold the aggregator signals every replica
(``truncate(version)`` on each `asyncrl.rollouter.actor.EngineActor`) to stop the round's
unfinished, truncatable requests. The threshold is set per round (`start_round`): what the
Trainer's step still lacks, so a round ends exactly when the step has its groups. (Async
mode's rounds end at the weight sync inside the engines, with no aggregator.)

Each stopped request returns its partial output with ``finish_reason="truncated"`` and the
Rollouter parks it in its partial buffer.

What is counted: the trajectories of *complete* groups, ``n`` per group. A finished
trajectory whose siblings are still running gives the Trainer nothing, so counting it could
end a round before the Trainer has its groups; the truncated responses would then wait for
a weight sync that never comes.

The class is plain Python (usable in-process); `remote_aggregator_actor` makes the Ray actor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from asyncrl import rpc
from asyncrl.rpc import Links
from asyncrl.calls import call_within

log = logging.getLogger("asyncrl.rollouter.aggregator")


class AggregatorActor:
    """Counts completions per round across ``engines`` and truncates at the round's threshold.

    ``threshold``: trajectories that end a round unless `start_round` sets the round's own;
    None: no round ends until `start_round` gives it a ``need``.
    """

    def __init__(self, engines: Sequence[Any], threshold: int | None, *, signal_timeout_s: float = 60.0,
                 rpc: bool = True):
        if threshold is not None and threshold < 1:
            raise ValueError(f"AggregatorActor threshold must be >= 1 (or None), got {threshold}")
        if not engines:
            raise ValueError("AggregatorActor needs the engine replicas it signals")
        self.engines = list(engines)
        self._rpc = rpc
        self._linked: set[int] = set()
        """Replicas signalled over ZeroMQ (`asyncrl.rpc.link`, made from their first signal on)."""
        self._links = Links()
        self._linking: asyncio.Future | None = None
        self.threshold = threshold
        self.signal_timeout_s = signal_timeout_s
        self.round = 0
        self.round_threshold = threshold
        """The count that ends the current round (None: none does)."""
        self.count = 0
        self.per_replica: dict[int, int] = {}
        self.truncated_rounds: dict[int, int] = {}
        """round -> requests stopped by its truncation signals."""
        self.signalled = False
        self._armed = False
        """A round has been given its ``need`` since this aggregator began."""

    async def start_round(self, version: int, need: int | None = None) -> None:
        """Weight version ``version`` is live: a new round with a fresh count. ``need``: the
        round ends once ``need`` more trajectories are counted from now (given again for the
        current round, it moves that round's end and re-arms its signal: the Trainer dropped
        groups it had counted on)."""
        if version > self.round:
            self.round, self.count, self.per_replica, self.signalled = version, 0, {}, False
            self.round_threshold = self.threshold
        if version == self.round and need is not None:
            self.round_threshold = self.count + need
            # Re-armed (or armed first by a Rollouter that resumes on replicas a former one
            # closed this round on): the replicas start this round's requests again.
            if (self.signalled or not self._armed) and need > 0:
                self.signalled, self._armed = False, True
                await self._each("reopen", version)

    async def report(self, version: int, per_replica: Mapping[int, int]) -> bool:
        """A group finished in round ``version``; ``per_replica``: replica -> trajectories it
        finished. Returns True when this report ended the round (the replicas were signalled)."""
        await self.start_round(version)
        if version < self.round:
            return False  # a late report of a round already over
        for replica, k in per_replica.items():
            self.per_replica[int(replica)] = self.per_replica.get(int(replica), 0) + int(k)
            self.count += int(k)
        if self.signalled or self.round_threshold is None or self.count < self.round_threshold:
            return False
        self.signalled = True
        # By count: queued requests stop too (queued=True), the engines idle until the next round.
        stopped = sum(int(out) for out in await self._each("truncate", version, True) if out is not None)
        self.truncated_rounds[version] = self.truncated_rounds.get(version, 0) + stopped
        return True

    async def _each(self, method: str, version: int, *args: Any) -> list:
        """``method(version, *args)`` on every replica; a dead or stuck replica is logged (its
        answer None), not waited for."""
        if self._rpc and len(self._linked) < len(self.engines) and (self._linking is None or self._linking.done()):
            self._linking = asyncio.ensure_future(self._link())  # for later signals; this one goes as it can now
        outs = await asyncio.gather(*(call_within(e, method, self.signal_timeout_s, version, *args) for e in self.engines),
                                    return_exceptions=True)
        for i, out in enumerate(outs):
            if isinstance(out, BaseException):
                log.warning("aggregator: replica %d did not take %s of round %d: %r", i, method, version, out)
        return [None if isinstance(out, BaseException) else out for out in outs]

    async def _link(self) -> None:
        todo = [i for i in range(len(self.engines)) if i not in self._linked]
        # (the rest: at a later signal)
        self._linked |= await rpc.link_each(self.engines, todo, self.signal_timeout_s, self._links)

    async def replace_engine(self, index: int, engine: Any) -> None:
        """Replica ``index`` was started again: signal the new one."""
        self.engines[index] = engine
        self._linked.discard(index)

    async def close(self) -> None:
        """Stop linking and close the sockets to the replicas (`Links.close`): the run's shutdown."""
        if self._linking is not None:
            self._linking.cancel()
            await asyncio.gather(self._linking, return_exceptions=True)
        self._links.close()

    async def stats(self) -> dict:
        return {"round": self.round, "count": self.count, "threshold": self.round_threshold,
                "per_replica": dict(self.per_replica), "truncated_rounds": dict(self.truncated_rounds)}


def remote_aggregator_actor(**options):
    """The Ray actor class: ``remote_aggregator_actor().remote(engines, threshold)``."""
    import ray

    return ray.remote(num_cpus=0, **options)(AggregatorActor)
