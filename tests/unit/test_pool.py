"""Dispatch by group (`asyncrl.rollouter.pool`), in process: simulated replicas inside `EngineActor`s."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asyncrl.queue.memory import MemorySink
from asyncrl.rollouter.actor import EngineActor
from asyncrl.rollouter.pool import EnginePool, GroupCalls
from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
from asyncrl.types import GenerateRequest, SamplingParams


class SpyActor(EngineActor):
    """An `EngineActor` over a simulated engine that records its group calls and aborts."""

    def __init__(self, **kwargs):
        super().__init__(kind="sim", **kwargs)
        self.group_calls: list[list[str]] = []
        self.aborts: list[list[str]] = []

    async def generate_group(self, requests, truncatable=False, batch_s=0.0):
        self.group_calls.append([r.request_id for r in requests])
        async for batch in super().generate_group(requests, truncatable, batch_s):
            yield batch

    async def abort(self, request_ids):
        self.aborts.append(list(request_ids))
        await super().abort(request_ids)


def _prompts(count: int) -> list[Prompt]:
    return [Prompt(text=str(i), prompt_ids=np.array([1, 4 + i, 5], dtype=np.int64)) for i in range(count)]


def _reward(prompt, response_ids) -> float:
    return float(len(response_ids))


def _request(rid: str, seed: int = 0) -> GenerateRequest:
    return GenerateRequest(rid, np.array([1, 2, 3], dtype=np.int64), max_tokens=8, sampling=SamplingParams(seed=seed))


@pytest.mark.parametrize("result_batch_s", [0.02, None])  # streamed in batches; in one plain call
async def test_each_group_goes_in_one_call_to_one_replica_and_the_load_spreads(result_batch_s):
    actors = [SpyActor(max_running=32, tokens_per_s=4000.0, seed=0) for _ in range(3)]
    try:
        cfg = RolloutConfig(n=4, max_tokens=8, groups_per_sync=30, max_concurrent=6, result_batch_s=result_batch_s)
        r = Rollouter(cfg, actors, MemorySink(), _prompts(8), _reward)
        await asyncio.wait_for(r.run(num_groups=30), 60)
    finally:
        for a in actors:
            await a.close()
    calls = [c for a in actors for c in a.group_calls]
    assert len(calls) == 30 and r.pool.calls == 30  # one call per group
    for c in calls:  # a call holds one group's n requests
        assert len(c) == 4 and len({rid.rsplit("/", 1)[0] for rid in c}) == 1
    assert sorted(rid.rsplit("/", 1)[0] for c in calls for rid in c[:1]) == sorted(g.sample_id for g in r.producer.groups)
    assert all(len(a.group_calls) >= 5 for a in actors)  # least-loaded choice spreads the groups
    assert 0 <= r.stats_now()["requests_spread"] < 1
    stats = [await a.stats() for a in actors]
    assert sum(s["requests"] for s in stats) == 120
    assert sum(s["groups"] for s in stats) == 0  # the simulated engine does not say what it prefilled: no prefill figures


async def test_a_group_sticks_to_its_replica_until_it_dies():
    actors = [SpyActor(max_running=8, tokens_per_s=4000.0, seed=0) for _ in range(2)]
    pool = EnginePool(actors, timeout_s=30.0)
    calls = GroupCalls(pool)
    try:
        _, first = await calls.generate(_request("g/0"), False)
        pool.load[first] += 100  # the group's replica looks busy: the group stays anyway
        _, again = await calls.generate(_request("g/1"), False)
        assert again == first
        pool.mark_dead(first, RuntimeError("gone"))
        _, moved = await calls.generate(_request("g/2"), False)
        assert moved == 1 - first
        with pytest.raises(Exception, match="every engine replica is dead"):
            pool.mark_dead(moved, RuntimeError("gone"))
            await calls.generate(_request("g/3"), False)
    finally:
        await calls.close()
        for a in actors:
            await a.close()


async def test_a_timed_out_call_is_aborted_whole_on_its_replica():
    actor = SpyActor(max_running=8, tokens_per_s=4000.0, seed=0)
    try:
        await actor.pause("keep")  # a pause the Rollouter was not told about: a stuck replica
        cfg = RolloutConfig(n=3, max_tokens=8, groups_per_sync=10, request_timeout_s=0.3)
        r = Rollouter(cfg, [actor], MemorySink(), _prompts(1), _reward)
        await asyncio.wait_for(r.run(num_groups=1), 30)
        group = r.producer.groups[0]
        assert group.status == "failed" and group.error.count("request_timeout_s=0.3") == 3
        assert actor.aborts == [actor.group_calls[0]] and len(actor.aborts[0]) == 3  # one abort, every id of the call
        assert r.stats_now()["timed_out"] == 3
        stats = await actor.stats()
        assert stats["running"] == 0 and stats["queued"] == 0
    finally:
        await actor.resume()
        await actor.close()


async def test_results_of_a_call_come_back_in_batches_as_they_end():
    actor = EngineActor(kind="sim", max_running=8, tokens_per_s=200.0, seed=0, median_tokens=2, long_tail=8)
    try:
        requests = [GenerateRequest(f"b/{k}", np.array([1, 2], dtype=np.int64), max_tokens=16,
                                    sampling=SamplingParams(seed=k)) for k in range(8)]
        batches = [batch async for batch in actor.generate_group(requests, False, 0.0)]
        lengths = {i: len(res.response_ids) for batch in batches for i, res in batch}
        assert sorted(lengths) == list(range(8))
        assert 2 <= len(batches) <= len(set(lengths.values()))  # a batch per moment responses end (a late wake may merge two)
        one = [batch async for batch in actor.generate_group(
            [GenerateRequest(f"c/{k}", r.prompt_ids, r.max_tokens, r.sampling) for k, r in enumerate(requests)],
            False, 5.0)]
        assert len(one) == 1 and len(one[0]) == 8  # within batch_s of the first: one message
    finally:
        await actor.close()


async def _until(condition, timeout_s: float) -> None:
    """Return once ``condition()`` holds; fail after ``timeout_s``."""
    async def poll():
        while not condition():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


async def test_a_replica_started_again_is_sent_groups_again_and_the_in_flight_counts_stay_right():
    """`Rollouter.replace_engine` alone: a replica whose engine died under its calls is marked dead
    (what was on it goes whole to the other), and once replaced the pool sends it groups again; no
    request stays counted in flight on either index."""
    live, dying, fresh = (SpyActor(max_running=32, tokens_per_s=4000.0, seed=0) for _ in range(3))
    cfg = RolloutConfig(n=4, max_tokens=8, groups_per_sync=100, max_concurrent=4)
    r = Rollouter(cfg, [live, dying], MemorySink(), _prompts(8), _reward)
    try:
        await dying.pause("keep")  # its requests stay in flight until it dies
        run = asyncio.ensure_future(r.run(num_groups=8))
        await _until(lambda: dying.group_calls and r.pool.load[1] > 0, 30)
        await dying.close()  # its engine dies under the call: EngineClosedError, the replica is dead
        await asyncio.wait_for(run, 60)
        assert r.pool.dead_engines == 1 and r.pool.load == [0, 0] and not r.pool._in_flight
        assert len(r.producer.groups) == 8 and all(g.status != "failed" for g in r.producer.groups)
        to_dead = len(dying.group_calls)

        await r.replace_engine(1, fresh)
        await asyncio.wait_for(r.run(num_groups=12), 60)
        groups = r.producer.groups[8:]
        assert len(groups) == 12 and all(g.status != "failed" for g in groups)
        assert len(fresh.group_calls) >= 3, (len(live.group_calls), len(fresh.group_calls))  # it serves again
        assert len(dying.group_calls) == to_dead  # nothing more to the dead actor
        assert (await fresh.stats())["tokens_generated"] > 0
        assert r.pool.load == [0, 0] and not r.pool._in_flight
    finally:
        for a in (live, dying, fresh):
            await a.close()


async def test_a_call_cancelled_from_outside_is_not_a_timeout():
    """The deadline is a timer on the calling task: an outside cancel goes through as a cancel (no
    abort, nothing counted timed out, the replica's load back to zero), and the pool serves the
    next call."""
    actor = SpyActor(max_running=8, tokens_per_s=4000.0, seed=0)
    pool = EnginePool([actor], timeout_s=30.0)
    try:
        await actor.pause("keep")  # the request waits on the engine until cancelled
        calls = GroupCalls(pool)
        task = asyncio.create_task(calls.generate(_request("g/0"), False))
        while pool.load[0] == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await calls.close()
        assert pool.timed_out == 0 and actor.aborts == [] and pool.load == [0]
        await actor.resume()
        result, replica = await asyncio.wait_for(GroupCalls(pool).generate(_request("g/1"), False), 30)
        assert replica == 0 and len(result.response_ids) > 0 and pool.load == [0] and pool.timed_out == 0
    finally:
        await actor.resume()
        await actor.close()


async def test_each_requests_record_notes_its_replica_as_it_goes_out():
    """`GroupCalls` writes the replica on the request's record when the call goes out, before any
    result (a conversation aborts a turn it gives up there, and ends its sessions there); after a
    replica's death the next request's record names the one the group moved to."""

    class Record:
        replica = -1

    actors = [SpyActor(max_running=8, tokens_per_s=4000.0, seed=0) for _ in range(2)]
    pool = EnginePool(actors, timeout_s=30.0)
    pool.load[0] += 100  # the group goes to replica 1
    calls, held, moved = GroupCalls(pool), Record(), Record()
    try:
        await actors[1].pause("keep")  # the request waits on the engine: no result yet
        task = asyncio.create_task(calls.generate(_request("g/0"), False, held))
        while pool.load[1] == 0:
            await asyncio.sleep(0.01)
        assert held.replica == 1 and not task.done()
        await actors[1].resume()
        _, replica = await asyncio.wait_for(task, 30)
        assert replica == 1 == held.replica
        pool.load[0] -= 100
        pool.mark_dead(1, RuntimeError("gone"))
        _, replica = await asyncio.wait_for(calls.generate(_request("g/1"), False, moved), 30)
        assert replica == 0 == moved.replica and held.replica == 1 and calls.replica == 0
    finally:
        for a in actors:
            await a.resume()
            await a.close()
