"""`scripts/bench_agent_env.SlowToolEnv`: 2-4 turns drawn per conversation, a tool latency between
turns from its log-normal, the reward the share of turns that answered the sum."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_agent_env import Z99, SlowToolEnv  # noqa: E402


async def test_turns_latency_and_reward(monkeypatch):
    monkeypatch.setenv("ASYNCRL_BENCH_TOOL_MEDIAN_S", "0.01")
    monkeypatch.setenv("ASYNCRL_BENCH_TOOL_P99_S", "0.05")
    env = SlowToolEnv()
    assert math.isclose(env.sigma * Z99, math.log(5)) and math.isclose(math.exp(env.mu), 0.01)
    assert await env.reset(SimpleNamespace(text="12+34=")) == "12+34="
    assert env.turns in (2, 3, 4)
    answers = ["46"] + ["7"] * (env.turns - 1)
    for text in answers[:-1]:
        t0 = time.perf_counter()
        step = await env.step(text)
        assert step.observation == "\n12+34=" and step.tool_calls == 1 and not step.done
        assert 0.001 < time.perf_counter() - t0 < 1.0  # a draw of the tool's latency (p99 50 ms)
    last = await env.step(answers[-1])
    assert last.done and last.reward == 1 / env.turns  # only the first turn answered right
    drawn = set()
    for _ in range(40):
        e = SlowToolEnv()
        await e.reset(SimpleNamespace(text="1+2="))
        drawn.add(e.turns)
    assert drawn == {2, 3, 4}
