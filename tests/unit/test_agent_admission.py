"""The feed's admission burst counts conversations when an agent loop runs: a sync (or the start)
that opens the gate for many groups starts at most `_ADMIT_BURST` conversations per turn of the
event loop, since each renders its prompt on the loop before its first await."""

from __future__ import annotations

import asyncio

import numpy as np

from asyncrl.agent.base import AgentLoop, AgentTrajectory
from asyncrl.queue.memory import MemorySink
from asyncrl.rollouter.actor import EngineActor
from asyncrl.rollouter.agents import Agent
from asyncrl.rollouter.rollouter import _ADMIT_BURST, Prompt, RolloutConfig, Rollouter


class Ticks:
    """Turns of the event loop so far (a task that yields once per turn)."""

    def __init__(self) -> None:
        self.now = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0)
            self.now += 1


class OneTurn(AgentLoop):
    """Notes the loop turn it started in, then generates one turn."""

    def __init__(self, ticks: Ticks) -> None:
        self.ticks, self.started = ticks, []

    async def run(self, prompt, llm) -> AgentTrajectory:
        self.started.append(self.ticks.now)
        turn = await llm.generate(prompt.prompt_ids, max_tokens=4)
        return AgentTrajectory(prompt.prompt_ids, turn.token_ids, np.ones(len(turn.token_ids)), turn.logprobs,
                               turn.versions, "length" if turn.finish_reason == "length" else "stop", reward=1.0, turns=1)


async def test_a_wide_open_gate_starts_at_most_a_burst_of_conversations_per_loop_turn():
    ticks = Ticks()
    loop = OneTurn(ticks)
    engines = [EngineActor(kind="sim", max_running=256, tokens_per_s=1e6, seed=i) for i in range(2)]
    groups = 40  # x n=8: 320 conversations admitted at once
    cfg = RolloutConfig(n=8, max_tokens=4, groups_per_sync=groups, max_concurrent=groups)
    prompts = [Prompt(text="x", prompt_ids=np.array([1, 4 + i % 20, 5])) for i in range(groups)]
    sink = MemorySink()
    r = Rollouter(cfg, engines, sink, prompts, lambda p, ids: 0.0, agent=Agent(loop, "test"))
    ticker = asyncio.create_task(ticks.run())
    try:
        await r.run(num_groups=groups)
    finally:
        ticker.cancel()
        for e in engines:
            await e.close()
    assert len(sink.groups) == groups and all(g.complete for g in sink.groups)
    per_turn = np.bincount(loop.started)
    assert len(loop.started) == groups * 8
    assert per_turn.max() <= _ADMIT_BURST  # before: 64 groups' worth (512 conversations) in one turn
