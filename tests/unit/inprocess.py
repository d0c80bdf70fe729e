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


class RecordingEngine:
    """An engine handle for the Rollouter that notes every request it is sent and each one's finish
    reason (``finished``: request id -> reason), passing every other call through."""

    def __init__(self, inner):
        self.inner, self.requests, self.finished = inner, [], {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate_group(self, requests, truncatable=False, batch_s=0.0):
        self.requests.extend(requests)
        async for batch in self.inner.generate_group(requests, truncatable, batch_s):
            self.finished.update((requests[i].request_id, r.finish_reason) for i, r in batch)
            yield batch


class CheckpointWhileTruncated:
    """Called at a sync's pause (after ``on_pause``): the first time a truncated turn waits in the
    partial buffer, take the snapshot a checkpoint takes there and note what was sent before it and
    which samples' turns wait (``truncated``: a request of ``recordings`` stopped "truncated" whose
    resumed request, ``{request_id}/{age}``, was not sent yet)."""

    def __init__(self, recordings: list[RecordingEngine]):
        self.recordings = recordings
        self.saved: dict | None = None
        self.sent: list[str] = []
        self.waiting = 0
        self.truncated: set[str] = set()

    def __call__(self, r) -> None:
        if self.saved is not None or not len(r.partials):
            return
        self.saved, self.waiting = r.snapshot(), len(r.partials)
        self.sent = [g.sample_id for g in r.producer.groups]
        sent = {q.request_id for e in self.recordings for q in e.requests}
        for e in self.recordings:
            for request_id, reason in e.finished.items():
                sample_id, k, turn, *age = request_id.split("/")
                if reason == "truncated" and f"{sample_id}/{k}/{turn}/{int(age[0]) + 1 if age else 1}" not in sent:
                    self.truncated.add(sample_id)


async def resume_from_checkpoint(check: CheckpointWhileTruncated, cfg, engine, prompts, agent) -> list[Group]:
    """Resume a Rollouter from ``check``'s snapshot (``sent``: trained by the checkpoint) on
    ``engine`` (no partial rollout) and generate what was in flight. Asserts the snapshot saved no
    parts of the turns that waited truncated (their samples in flight at the checkpoint) and that
    each conversation in flight is generated again from its first turn; returns the resumed groups."""
    import dataclasses

    import numpy as np

    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.rollouter import Rollouter, RolloutState
    from asyncrl.types import CommittedSet

    saved = check.saved
    assert saved is not None and check.waiting >= 1, "no truncated turn waited at any sync"
    assert saved["partials"] == {}  # a conversation's truncated turn is never checkpointed...
    truncated = check.truncated
    assert truncated and truncated <= set(saved["in_flight"]), (truncated, saved["in_flight"])  # ...it is in flight
    state = RolloutState.resume(saved, CommittedSet(check.sent), 0, rows=len(prompts))
    assert state.partials == {} and len(state.pending) == len(saved["in_flight"])
    recording = RecordingEngine(engine)
    cfg = dataclasses.replace(cfg, groups_per_sync=1000)  # no sync comes: a budget for all the pending groups
    again = Rollouter(cfg, [recording], MemorySink(), prompts, lambda p, ids: 0.0, state=state, agent=agent)
    await asyncio.wait_for(again.run(num_groups=len(saved["in_flight"])), 120)
    groups = again.producer.groups
    assert sorted(g.sample_id for g in groups) == sorted(saved["in_flight"]) and all(g.complete for g in groups)
    by_id = {q.request_id: q for q in recording.requests}
    for g in groups:
        for t in g.trajectories:
            # From its first turn: turn 0 on the bare prompt, then turn 1, no resumed ("/age") request.
            first = by_id[f"{g.sample_id}/{t.index}/t0"]
            assert np.array_equal(first.prompt_ids, t.prompt_ids) and t.age == 0
            assert sorted(q for q in by_id if q.startswith(f"{g.sample_id}/{t.index}/")) == [
                f"{g.sample_id}/{t.index}/t{j}" for j in range(t.turns)]
    return groups
