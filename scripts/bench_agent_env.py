"""The env of `bench_agent.py`: the built-in addition task asked again over 2-4 turns, with a tool's
long-tailed latency between turns (named by path: ``rollout.agent.env=bench_agent_env:SlowToolEnv``,
with this folder on ``PYTHONPATH``).

Each conversation draws, seeded by its prompt and sample, 2-4 model turns. After every turn but
the last it "calls a tool": it sleeps a latency drawn from a log-normal with median
``ASYNCRL_BENCH_TOOL_MEDIAN_S`` (0.2 s) and p99 ``ASYNCRL_BENCH_TOOL_P99_S`` (2 s), then shows the
question again as the observation. The reward is the share of the conversation's turns that
answer the sum right: the warm-started model answers the first turn about as well as the demo's
single turn and the later ones (a longer context than it was trained on) worse, which RL can fix.
The conversations' wall time is mostly tool time.
"""

from __future__ import annotations

import asyncio
import math
import os
import random

from asyncrl.agent import Env, Step

Z99 = 2.3263478740408408  # the standard normal's 99th percentile


class SlowToolEnv(Env):
    asked: dict[str, int] = {}

    def __init__(self):
        median = float(os.environ.get("ASYNCRL_BENCH_TOOL_MEDIAN_S", "0.2"))
        p99 = float(os.environ.get("ASYNCRL_BENCH_TOOL_P99_S", "2.0"))
        self.mu, self.sigma = math.log(median), math.log(p99 / median) / Z99
        self.turn = 0

    async def reset(self, prompt):
        self.question = prompt.text
        a, b = prompt.text.rstrip("=").split("+")
        self.answer, self.right = str(int(a) + int(b)), 0
        # Seeded by the prompt and how often it was asked in this process (the k-th sample of its
        # group on a first pass): runs of every mode draw alike.
        seen = SlowToolEnv.asked[prompt.text] = SlowToolEnv.asked.get(prompt.text, 0) + 1
        self.rng = random.Random(f"{prompt.text}|{seen}")
        self.turns = self.rng.choice((2, 3, 4))
        return prompt.text

    async def step(self, text: str) -> Step:
        self.turn += 1
        self.right += text.strip() == self.answer
        if self.turn >= self.turns:
            return Step(done=True, reward=self.right / self.turns)
        await asyncio.sleep(math.exp(self.rng.gauss(self.mu, self.sigma)))
        return Step(observation="\n" + self.question, tool_calls=1)
