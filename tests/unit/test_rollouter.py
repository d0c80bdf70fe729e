"""The Rollouter in-process: feed order, group assembly, rewards, the staleness gate, failures."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from asyncrl.queue.memory import MemorySink

ListProducer = MemorySink  # main's partial-rollout tests still use the old name
from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter, RolloutState
from asyncrl.rollouter.engines.builtin.engine import TorchEngine
from asyncrl.types import parse_sample_id


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the engine runs in this process; the machine's cores are shared


class BrokenEngine:
    async def generate(self, request):
        raise RuntimeError("engine out of memory")


def make_prompts(k=3):
    return [Prompt(text=f"p{i}", prompt_ids=np.array([1, 4 + i, 5], dtype=np.int64)) for i in range(k)]


def length_reward(prompt, response_ids):
    return float(len(response_ids))


async def test_groups_in_feed_order_with_rewards_and_versions(model_path):
    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        producer = MemorySink()
        cfg = RolloutConfig(n=3, max_tokens=4, groups_per_sync=100, max_concurrent=2)
        r = Rollouter(cfg, [engine], producer, make_prompts(3), length_reward, state=RolloutState(next_index=7))
        await asyncio.wait_for(r.run(num_groups=5), 120)
    finally:
        await engine.close()
    ids = sorted(producer.groups, key=lambda g: parse_sample_id(g.sample_id)[1])
    # Feed index continues from the resumed state and never restarts at the epoch boundary.
    assert [g.sample_id for g in ids] == ["sample_0_7", "sample_0_8", "sample_0_9", "sample_1_10", "sample_1_11"]
    for g in producer.groups:
        assert g.complete and g.expected == 3
        assert sorted(t.index for t in g.trajectories) == [0, 1, 2]
        for t in g.trajectories:
            assert len(t.response_ids) == 4 and t.finish_reason == "length"
            assert t.reward == 4.0
            assert (t.versions == 0).all()
    assert r.state.next_index == 12


async def test_staleness_gate_admits_per_version(model_path, until):
    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        producer = MemorySink()
        cfg = RolloutConfig(n=2, max_tokens=2, groups_per_sync=2, staleness_threshold=0.5, max_concurrent=8)
        r = Rollouter(cfg, [engine], producer, make_prompts(4), length_reward)
        task = asyncio.create_task(r.run(num_groups=10))
        # version 0: (0 + 1 + 0.5) * 2 = 3 prompts may be admitted, then the gate holds: once
        # the 3 are sent, its condition is false, so nothing more is admitted until a sync.
        await producer.wait_for(3, 60)
        await until(lambda: r.sent == 3, 60, "the third group to be counted as sent")
        assert r.admitted == 3 and not r._admissible()
        await r.on_sync(1)  # one sync later the budget is (1 + 1 + 0.5) * 2 = 5
        await producer.wait_for(5, 60)
        await until(lambda: r.sent == 5, 60, "the fifth group to be counted as sent")
        assert r.admitted == 5 and len(producer.groups) == 5 and not r._admissible()
        await r.on_sync(4)  # budget (4 + 1 + 0.5) * 2 = 11 >= 10
        await asyncio.wait_for(task, 60)
        assert len(producer.groups) == 10
    finally:
        await engine.close()


async def test_engine_failure_fails_the_group_with_the_error():
    producer = MemorySink()
    cfg = RolloutConfig(n=2, max_tokens=2, groups_per_sync=10)
    r = Rollouter(cfg, [BrokenEngine()], producer, make_prompts(1), length_reward)
    await asyncio.wait_for(r.run(num_groups=2), 30)
    assert len(producer.groups) == 2
    for g in producer.groups:
        assert g.status == "failed" and not g.complete
        assert "engine out of memory" in g.error and g.trajectories == []
    assert r.failed == 2


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="RolloutConfig.n "):
        RolloutConfig(n=0)
    with pytest.raises(ValueError, match="staleness_threshold"):
        RolloutConfig(staleness_threshold=-1)


class _HandClock:
    """The Rollouter's clock (its module's ``time``), moved only by the test: the request deadline
    then depends on what the test says happened, never on how busy the machine is."""

    def __init__(self):
        self.now, self.reads = 1000.0, 0

    def monotonic(self) -> float:
        self.reads += 1
        return self.now


async def test_pause_time_does_not_count_and_a_timed_out_request_is_aborted_on_its_engine(model_path, monkeypatch,
                                                                                                until):
    import asyncrl.rollouter.rollouter as rollouter_module

    clock = _HandClock()
    monkeypatch.setattr(rollouter_module, "time", clock)
    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        cfg = RolloutConfig(n=1, max_tokens=2, groups_per_sync=10, request_timeout_s=0.5)
        # A weight sync the Rollouter was told about, 120 times the timeout: the group still finishes.
        producer = MemorySink()
        r = Rollouter(cfg, [engine], producer, make_prompts(1), length_reward)
        await engine.pause("keep")
        await r.on_pause()
        task = asyncio.create_task(r.run(num_groups=1))
        await until(lambda: engine.stats()["queued"] == 1)  # the request waits on the paused engine
        clock.now += 60.0
        seen = clock.reads
        await until(lambda: clock.reads > seen)  # the request's deadline was checked after the minute
        await engine.resume()
        await r.on_sync(1)
        await asyncio.wait_for(task, 60)
        assert producer.groups[0].complete and r.stats.timed_out == 0
        # A pause it was not told about is just a slow engine: past the timeout the request is
        # aborted on the engine, not left queued there.
        producer = MemorySink()
        r = Rollouter(cfg, [engine], producer, make_prompts(1), length_reward)
        await engine.pause("keep")
        task = asyncio.create_task(r.run(num_groups=1))
        await until(lambda: engine.stats()["queued"] == 1)
        clock.now += 1.0
        await asyncio.wait_for(task, 60)
        g = producer.groups[0]
        assert g.status == "failed" and "request_timeout_s=0.5" in g.error and r.stats.timed_out == 1
        assert engine.stats()["queued"] == 0 and engine.stats()["running"] == 0
        await engine.resume()
    finally:
        await engine.close()


async def test_rewards_run_off_the_event_loop(model_path):
    import threading

    engine = TorchEngine(model_path, eos_token_ids=())
    threads = []

    def blocking_reward(text, ids):
        threads.append(threading.get_ident())
        return 1.0

    async def async_reward(text, ids):
        await asyncio.sleep(0)
        return 2.0

    try:
        for fn, value in ((blocking_reward, 1.0), (async_reward, 2.0)):
            producer = MemorySink()
            r = Rollouter(RolloutConfig(n=2, max_tokens=2, groups_per_sync=10), [engine], producer,
                          make_prompts(1), fn)
            await asyncio.wait_for(r.run(num_groups=2), 60)
            assert all(t.reward == value for g in producer.groups for t in g.trajectories)
    finally:
        await engine.close()
    assert len(threads) == 4 and threading.get_ident() not in threads


async def test_a_resume_regenerates_pending_ids_first_with_the_same_tokens_then_continues_the_feed(model_path):
    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        cfg = RolloutConfig(n=2, max_tokens=4, groups_per_sync=100, max_concurrent=1, seed=3)
        first = MemorySink()
        await asyncio.wait_for(Rollouter(cfg, [engine], first, make_prompts(3), length_reward).run(num_groups=8), 120)
        # A checkpoint taken at next_index=6 with 0, 1, 3 and 5 trained: 2 and 4 were admitted, not trained.
        resumed = MemorySink()
        state = RolloutState(epoch=2, position=0, next_index=6, pending=[2, 4], done=4)
        r = Rollouter(cfg, [engine], resumed, make_prompts(3), length_reward, state=state)
        assert r.admitted == 4
        await asyncio.wait_for(r.run(num_groups=4), 120)
    finally:
        await engine.close()
    assert [g.sample_id for g in resumed.groups] == ["sample_0_2", "sample_1_4", "sample_2_6", "sample_2_7"]
    assert r.state.next_index == 8 and r.state.pending == []
    before = {g.sample_id: g for g in first.groups}
    for g in resumed.groups:  # same id -> same prompt and sampling seeds -> same tokens on the same weights
        old = before[g.sample_id]
        assert g.meta["prompt"] == old.meta["prompt"]
        for t, u in zip(sorted(g.trajectories, key=lambda t: t.index), sorted(old.trajectories, key=lambda t: t.index)):
            assert np.array_equal(t.response_ids, u.response_ids)
            np.testing.assert_allclose(t.logprobs, u.logprobs, atol=1e-5)


async def test_the_gate_counts_groups_done_before_a_resume(model_path, until):
    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        producer = MemorySink()
        cfg = RolloutConfig(n=2, max_tokens=2, groups_per_sync=2, staleness_threshold=0.0)
        # Resumed at version 2 with 5 groups done, one of them dropped: 4 count against (2 + 1) * 2 = 6.
        r = Rollouter(cfg, [engine], producer, make_prompts(3), length_reward,
                      state=RolloutState(next_index=5, done=5, dropped=1))
        await r.on_sync(2)
        task = asyncio.create_task(r.run())
        await producer.wait_for(2, 60)
        await until(lambda: r.sent == 7, 60, "the second group to be counted as sent")
        assert r.admitted == 7 and not r._admissible()
        assert [g.sample_id for g in producer.groups] == ["sample_0_5", "sample_0_6"]
        await r.stop()
        await asyncio.wait_for(task, 30)
    finally:
        await engine.close()


class HangingEngine:
    """Generates nothing until its requests are aborted."""

    def __init__(self):
        self.started, self.aborted = [], []
        self._events = {}

    async def generate(self, request):
        self.started.append(request.request_id)
        await self._events.setdefault(request.request_id, asyncio.Event()).wait()
        raise AssertionError("an aborted request's result is never awaited")

    async def abort(self, request_ids):
        self.aborted.extend(request_ids)


async def test_stop_drains_in_flight_groups_and_aborts_their_requests(until):
    engines = [HangingEngine(), HangingEngine()]
    producer = MemorySink()
    cfg = RolloutConfig(n=2, max_tokens=2, groups_per_sync=10, max_concurrent=2)
    r = Rollouter(cfg, engines, producer, make_prompts(3), length_reward)
    task = asyncio.create_task(r.run())
    await until(lambda: sum(len(e.started) for e in engines) == 4, 30, "four requests on the engines")
    assert r.snapshot() == {"epoch": 0, "next_index": 2, "position": 2, "in_flight": ["sample_0_0", "sample_0_1"],
                            "unacked": [], "partials": {}}
    await r.stop()
    await asyncio.wait_for(task, 10)  # run() returns: nothing left in flight
    assert sorted(rid for e in engines for rid in e.aborted) == sorted(rid for e in engines for rid in e.started)
    assert producer.groups == [] and r.admitted == 2 and r.snapshot()["in_flight"] == []


def test_a_state_that_does_not_fit_the_dataset_is_refused():
    with pytest.raises(ValueError, match="pending holds 9, not below next_index=4"):
        Rollouter(RolloutConfig(), [BrokenEngine()], MemorySink(), make_prompts(3), length_reward,
                  state=RolloutState(next_index=4, position=1, epoch=1, pending=[9]))
    with pytest.raises(ValueError, match="feed index 1 does not fit"):
        Rollouter(RolloutConfig(), [BrokenEngine()], MemorySink(), make_prompts(3), length_reward,
                  state=RolloutState(next_index=4, pending=[1]))  # a feed that started at index 4


def test_resume_state_makes_every_uncommitted_id_below_the_feed_position_pending():
    from asyncrl.types import CommittedSet

    committed = CommittedSet(f"sample_{i // 3}_{i}" for i in (0, 1, 2, 3, 5, 7))
    saved = {"epoch": 3, "next_index": 9, "position": 0, "in_flight": ["sample_2_8"], "unacked": ["sample_1_4"]}
    st = RolloutState.resume(saved, committed, dropped=1, rows=3)
    assert (st.epoch, st.next_index, st.position) == (3, 9, 0) and st.pending == [4, 6, 8]
    assert (st.done, st.dropped) == (6, 1)
    # A feed position saved before ids it had fed were committed (the Rollouter died in between):
    # the feed moves past the highest committed id; the gaps below it are pending.
    stale = {"epoch": 1, "next_index": 4, "position": 1}
    st = RolloutState.resume(stale, committed, dropped=0, rows=3)
    assert (st.epoch, st.next_index, st.position) == (2, 8, 2) and st.pending == [4, 6]
    r = Rollouter(RolloutConfig(), [BrokenEngine()], MemorySink(), make_prompts(3), length_reward, state=st)
    assert [r._draw()[0] for _ in range(3)] == ["sample_1_4", "sample_2_6", "sample_2_8"]


async def test_a_dead_engine_is_left_out_and_its_requests_go_to_a_live_one(model_path):
    import ray

    class Dead:
        calls = 0

        async def generate(self, request):
            Dead.calls += 1
            raise ray.exceptions.ActorDiedError()

    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        producer = MemorySink()
        cfg = RolloutConfig(n=2, max_tokens=2, groups_per_sync=10, max_concurrent=1)
        r = Rollouter(cfg, [Dead(), engine], producer, make_prompts(2), length_reward)
        await asyncio.wait_for(r.run(num_groups=3), 60)
    finally:
        await engine.close()
    assert all(g.complete for g in producer.groups) and len(producer.groups) == 3
    assert Dead.calls == 1  # tried once, then left out
    only_dead = Rollouter(cfg, [Dead()], MemorySink(), make_prompts(1), length_reward)
    await asyncio.wait_for(only_dead.run(num_groups=1), 30)
    assert "every engine replica is dead" in only_dead.producer.groups[0].error
