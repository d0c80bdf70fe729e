"""Async reward tasks belong to their group: cancelled with it, never left running (`Rewards.owned`)."""

from __future__ import annotations

import asyncio

import numpy as np

from asyncrl.rollouter.rewards import Rewards


async def test_a_cancelled_group_cancels_the_async_rewards_its_responses_started():
    started: list[int] = []
    finished: list[int] = []
    release = asyncio.Event()

    async def slow_reward(prompt, response_ids) -> float:  # a judge call that outlasts the group
        started.append(prompt)
        await release.wait()
        finished.append(prompt)
        return 1.0

    rewards = Rewards(slow_reward, workers=1)
    responses_done = asyncio.Event()

    async def one_response(k: int):  # as `Rollouter._one_response`: the reward starts as it ends
        return rewards.start(k, np.arange(3))

    async def one_group():  # as `Rollouter.generate_group`: the responses in tasks, then the rewards
        pending = await asyncio.gather(*(one_response(k) for k in range(3)))
        responses_done.set()
        return [await Rewards.value(p) for p in pending]

    group = asyncio.ensure_future(Rewards.owned(one_group()))
    await asyncio.wait_for(responses_done.wait(), 10)
    while len(started) < 3:  # the three rewards are running (waiting on their judge)
        await asyncio.sleep(0.01)
    assert sorted(started) == [0, 1, 2]
    group.cancel()  # the Rollouter's stop cancels the group's task
    await asyncio.gather(group, return_exceptions=True)
    release.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert finished == []  # none ran on past its group
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert leftover == []


async def test_a_group_that_ends_keeps_its_rewards_and_owns_nothing_more():
    async def reward(prompt, response_ids) -> float:
        return float(prompt) + len(response_ids)

    rewards = Rewards(reward, workers=1)

    async def one_group():
        pending = await asyncio.gather(*(asyncio.sleep(0, rewards.start(k, np.arange(2))) for k in range(3)))
        return [await Rewards.value(p) for p in pending]

    assert await asyncio.ensure_future(Rewards.owned(one_group())) == [2.0, 3.0, 4.0]
