"""The agent stacks of ``examples/`` against the real endpoint: one episode each, token-exact.

Each stack (the ``openai`` loop, the Agents SDK, LangGraph, a command) runs one calculator episode
against an `EndpointLoop` (its real HTTP server, the real clients) whose policy is scripted: the
first call answers with a Hermes tool call, the second with the product. So every stack must
parse the tool call from the endpoint's response, run its client-side calculator, send the
result back with the echoed assistant turn, and the trajectory must hold exactly the sampled
tokens (loss mask 1) with the template's rendering of the tool result between them (mask 0).
The slow test trains the openai stack for real in ``--mode sync`` and checks exact tokens end to
end (the Trainer's importance ratio is 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from asyncrl.agent.base import Turn
from asyncrl.agent.endpoint.config import load_agent_function
from asyncrl.agent.endpoint.loop import EndpointLoop, EpisodeLimits
from asyncrl.models import default_model_path, load_tokenizer
from asyncrl.tasks.calculator import reward as task_reward

ROOT = Path(__file__).resolve().parents[2]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>'
STACKS = {
    "openai": {"function": "examples.openai_agent.agent:run"},
    "agents_sdk": {"function": "examples.agents_sdk_agent.agent:run"},
    "langgraph": {"function": "examples.langgraph_agent.agent:run"},
    "command": {"command": f"{sys.executable} examples/command_agent/agent.py"},
}


class ScriptedPolicy:
    """An `LLM` that samples a fixed turn per call (tool call, then the answer) and records what it saw."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer = tokenizer
        end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.turns = [np.asarray([*tokenizer.encode(t, add_special_tokens=False), end], np.int64) for t in turns]
        self.prompts: list[np.ndarray] = []

    async def generate(self, token_ids, *, max_tokens: int, stop: tuple[int, ...] = ()) -> Turn:
        ids = self.turns[len(self.prompts)]
        self.prompts.append(np.asarray(token_ids, np.int64))
        return Turn(ids, np.full(len(ids), -0.5, np.float32), np.zeros(len(ids), np.int64), "stop")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path("calculator"))


@pytest.mark.parametrize("stack", sorted(STACKS))
async def test_each_stack_runs_an_episode_token_exact(stack, tokenizer, monkeypatch):
    monkeypatch.chdir(ROOT)  # the command's path and the examples package are relative to the repository
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    spec = STACKS[stack]
    function = load_agent_function(spec["function"]) if "function" in spec else None
    loop = EndpointLoop(tokenizer, function=function, command=spec.get("command"),
                        limits=EpisodeLimits(max_calls=3, max_context_tokens=256, max_tokens_per_call=64))
    policy = ScriptedPolicy(tokenizer, [CALL, "1776"])
    row = {"prompt": "37*48=", "data_source": "asyncrl/calculator", "reward_model": {"ground_truth": "1776"}}
    try:
        trajectory = await loop.run(row, policy)
    finally:
        await loop.aclose()

    assert len(policy.prompts) == 2 and loop.counts["http_calls"] == 2 and loop.counts["http_forks"] == 0
    first, second = policy.prompts
    assert tokenizer.decode(first) == "<|im_start|>system\ntools: calculator<|im_end|>\n<|im_start|>user\n37*48=<|im_end|>\n<|im_start|>assistant\n"
    # The second call continues the first call's prompt and sampled ids exactly; then the tool's result.
    assert np.array_equal(second[:len(first) + len(policy.turns[0])], np.concatenate([first, policy.turns[0]]))
    assert "<tool_response>\n1776\n</tool_response>" in tokenizer.decode(second[len(first):])
    assert np.array_equal(trajectory.prompt_ids, first)
    trained = trajectory.response_ids[trajectory.loss_mask == 1]
    assert np.array_equal(trained, np.concatenate(policy.turns))  # every sampled token once, nothing else
    assert np.array_equal(trajectory.response_ids, np.concatenate([second[len(first):], policy.turns[1]]))
    assert np.all(trajectory.logprobs[trajectory.loss_mask == 1] == -0.5)
    assert trajectory.final_text == "1776" and task_reward("37*48=", trajectory.final_text) == 1.0
    # Function agents leave the score to the task's reward function; the command prints its own.
    assert trajectory.reward == (1.0 if stack == "command" else None)


@pytest.mark.slow
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_stack_trains_in_sync_mode_with_exact_tokens(stack, tmp_path):
    """``--mode sync`` through the endpoint: tool calls are made and trained, and the Trainer's
    importance ratio is 1 on every step (the trained tokens are the sampled ones). The openai stack
    runs 10 steps; the others 4, enough for several weight syncs at a fraction of the suite's time
    (`scripts/learn_calculator.py --agent STACK` runs them longer)."""
    run_dir = tmp_path / "run"
    steps = 10 if stack == "openai" else 4
    agent = [f"rollout.agent.{kind}={value}" for kind, value in STACKS[stack].items()]
    cmd = [sys.executable, "-m", "asyncrl.launch", "--task", "calculator", "--mode", "sync", "--steps", str(steps),
           "--groups-per-step", "4", "--n", "4", "--run-dir", str(run_dir), "max_restarts=0", "engine.kind=torch",
           *agent]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=280)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    ratios = [r[k] for r in rows for k in ("is_ratio_mean", "is_ratio_min", "is_ratio_max")]
    assert max(abs(v - 1.0) for v in ratios) < 1e-3, ratios  # every step, every token
    tokenizer = load_tokenizer(default_model_path("calculator"))
    calls = 0
    for line in (run_dir / "transcripts.jsonl").read_text().splitlines():
        record = json.loads(line)
        ids, mask = np.asarray(record["response_ids"]), np.asarray(record["loss_mask"])
        calls += tokenizer.decode(ids[mask == 1]).count("<tool_call>")
    assert calls > 0
