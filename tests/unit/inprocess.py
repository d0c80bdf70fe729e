"""The Rollouter and the Trainer in one process, for tests: the stream as a queue, a syncer that
tells the Rollouter of each sync (as the launcher's does), and a run of a few train steps."""

from __future__ import annotations

import asyncio

from asyncrl.types import Group


class QueueStream:
    """Producer and source in one process: what the ZeroMQ stream does, minus the sockets (it keeps
    the groups sent and not acked, as the producer does, for the Rollouter's snapshot)."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.acks: list[tuple[str, str | None]] = []
        self._unacked: dict[str, Group] = {}

    async def send(self, group):
        self._unacked[group.sample_id] = group
        await self.queue.put(group)

    async def recv(self, timeout=None):
        return await asyncio.wait_for(self.queue.get(), timeout)

    def ack(self, sample_ids, reason=None):
        self.acks.extend((sid, reason) for sid in sample_ids)
        for sid in sample_ids:
            self._unacked.pop(sid, None)

    @property
    def unacked(self) -> list[Group]:
        return list(self._unacked.values())


class NotifyingSyncer:
    """Pause the Rollouter, sync, tell it the new version."""

    def __init__(self, inner, rollouter):
        self.inner, self.rollouter = inner, rollouter

    async def sync(self):
        await self.rollouter.on_pause()
        version = await self.inner.sync()
        await self.rollouter.on_sync(version)
        return version


async def train_steps(tcfg, rcfg, engine, prompts, reward, steps: int, *, serving=None, step_timeout_s: float = 120,
                      agent=None):
    """``steps`` train steps of a Trainer (one local rank) fed by a Rollouter over ``engine``
    (``serving``: what the Rollouter calls instead, e.g. a wrapper of it; ``agent``: the Rollouter's
    agent loop, `build_agent`); the engine and the rank are closed after. Returns (the steps' results, the Rollouter, the Trainer, the stream)."""
    from asyncrl.rollouter.rollouter import Rollouter
    from asyncrl.sync.inprocess import InProcessSyncer
    from asyncrl.trainer.ranks import RankGroup
    from asyncrl.trainer.trainer import Trainer

    stream = QueueStream()
    ranks = RankGroup.start_local(tcfg)
    rollouter = Rollouter(rcfg, [serving or engine], stream, prompts, reward, agent=agent)
    trainer = Trainer(tcfg, ranks, stream, NotifyingSyncer(InProcessSyncer(ranks, [engine]), rollouter),
                      on_dropped=rollouter.on_dropped)
    feed = asyncio.create_task(rollouter.run())
    try:
        results = [await asyncio.wait_for(trainer.train_step(), step_timeout_s) for _ in range(steps)]
    finally:
        feed.cancel()
        await asyncio.gather(feed, return_exceptions=True)
        await engine.close()
        ranks.close()
    return results, rollouter, trainer, stream


async def snapshot_in_tool_call(cfg, engine, prompts, agent, called: asyncio.Event) -> dict:
    """Run one group on ``engine`` until ``called`` is set (its env waits in a tool call after turn
    0), take the snapshot a checkpoint takes and stop the Rollouter. The snapshot lists the
    conversation in flight with no saved parts, and nothing was sent; returns it."""
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.rollouter import Rollouter

    first = Rollouter(cfg, [engine], MemorySink(), prompts, lambda p, ids: 0.0, agent=agent)
    task = asyncio.create_task(first.run(num_groups=1))
    await asyncio.wait_for(called.wait(), 60)
    saved = first.snapshot()  # the checkpoint
    await first.stop()
    await asyncio.wait_for(task, 30)
    assert saved["in_flight"] == ["sample_0_0"] and saved["partials"] == {} and first.producer.groups == []
    return saved
