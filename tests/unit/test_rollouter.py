"""The Rollouter in-process: feed order, group assembly, rewards, the staleness gate, failures."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from asyncrl.queue.memory import MemorySink
from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter, RolloutState
from asyncrl.rollouter.torch_engine import TorchEngine
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


async def test_pause_time_does_not_count_and_a_timed_out_request_is_aborted_on_its_engine(model_path):
    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        cfg = RolloutConfig(n=1, max_tokens=2, groups_per_sync=10, request_timeout_s=0.5)
        # A weight sync the Rollouter was told about: 1.5 s paused, yet the group finishes.
        producer = MemorySink()
        r = Rollouter(cfg, [engine], producer, make_prompts(1), length_reward)
        await engine.pause("keep")
        await r.on_pause()
        task = asyncio.create_task(r.run(num_groups=1))
        await asyncio.sleep(1.5)
        await engine.resume()
        await r.on_sync(1)
        await asyncio.wait_for(task, 60)
        assert producer.groups[0].complete
        # A pause it was not told about is just a slow engine: the request times out and is
        # aborted on the engine, not left queued there.
        producer = MemorySink()
        r = Rollouter(cfg, [engine], producer, make_prompts(1), length_reward)
        await engine.pause("keep")
        await asyncio.wait_for(r.run(num_groups=1), 60)
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
