"""A function agent trained through its endpoint, on-policy: the Rollouter and a Trainer rank in this
process (no Ray) over the built-in engine and a tiny random chat model. Each episode makes three
calls over real HTTP with the real ``openai`` client, echoing each answer back; the trained tokens
are exactly what the engine sampled, so before each update the trainer's log-probs equal the
behaviour ones: ``is_ratio`` within 1e-3 of 1 on every step."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch

CALLS = 3


async def three_call_agent(row, client):
    """A multi-call agent: answer, be told to go on, answer again (each answer echoed back as is)."""
    c = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
    msgs = [{"role": "user", "content": row["prompt"]}]
    for k in range(CALLS):
        r = await c.chat.completions.create(model=client.model, messages=msgs, max_tokens=6)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"go on {k}"}]
    return float(len(r.choices[0].message.content or "") % 2)


async def _train(tmp_path, function: str, steps: int, **trainer):
    """``steps`` on-policy steps of the agent ``function`` (of this module) over the tiny chat model's
    endpoint on the built-in engine: 16 prompts, groups of 4, 2 groups a step; ``trainer``: more
    `TrainerConfig` fields. Returns the steps' results and the (closed) agent, for its counts."""
    from asyncrl.models import load_tokenizer
    from asyncrl.models.tiny_chat import build_chat_model
    from asyncrl.rollouter.agents import build_agent
    from asyncrl.rollouter.config import AgentConfig
    from asyncrl.rollouter.engines.builtin.engine import TorchEngine
    from asyncrl.rollouter.feed import Prompt
    from asyncrl.rollouter.rollouter import RolloutConfig
    from asyncrl.trainer.config import OptimConfig, TrainerConfig, WorkerConfig
    from tests.unit.inprocess import train_steps

    torch.set_num_threads(1)
    path = str(build_chat_model(tmp_path / "model"))
    tok = load_tokenizer(path)
    prompts = [Prompt(text=f"q{i}", prompt_ids=np.asarray(tok.encode(f"q{i}"), np.int64), meta={}) for i in range(16)]
    agent = build_agent(AgentConfig(function=f"tests.integration.test_endpoint_train:{function}", max_turns=CALLS,
                                    max_tokens_per_turn=6, max_context_tokens=512), tok)
    tcfg = TrainerConfig(worker=WorkerConfig(model_path=path, pad_token_id=tok.pad_token_id, optim=OptimConfig(lr=1e-3)),
                         groups_per_batch=2, recv_timeout_s=120, **trainer)
    rcfg = RolloutConfig(n=4, max_tokens=6, groups_per_sync=tcfg.groups_per_sync, staleness_threshold=0.0)
    try:
        results, _, _, _ = await train_steps(tcfg, rcfg, TorchEngine(path, seed=0), prompts,
                                             lambda p, ids: 0.0, steps, agent=agent)
    finally:
        await agent.aclose()
    return results, agent


async def test_a_function_agent_trains_on_policy_with_exact_tokens(tmp_path):
    # two steps: the second samples on the weights the first trained and synced (on-policy after a sync)
    results, agent = await _train(tmp_path, "three_call_agent", 2)
    assert len(results) == 2
    for r in results:
        m = r.metrics
        assert m["agent/turns_mean"] == CALLS and m["agent/turns_max"] == CALLS
        assert m["is_ratio_max"] == pytest.approx(1.0, abs=1e-3) and m["is_ratio_min"] == pytest.approx(1.0, abs=1e-3)
    counts = agent.loop.counts
    assert counts["http_forks"] == 0 and counts["http_failed_episodes"] == 0
    assert counts["http_calls"] >= CALLS * 2 * 2 * 4  # (episodes still in flight at the end were cancelled)


async def summarising_agent(row, client):
    """Two echoed calls; then every other episode replaces its history with a summary (a second branch)."""
    c = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
    msgs = [{"role": "user", "content": row["prompt"]}]
    for k in range(2):
        r = await c.chat.completions.create(model=client.model, messages=msgs, max_tokens=6)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"go on {k}"}]
    episode = int(client.base_url.split("/s/")[1].split("-")[1])  # {sample_id}-{k}-{hex}
    if episode % 2 == 0:
        summary = [{"role": "user", "content": "so far: " + (r.choices[0].message.content or "")}]
        await c.chat.completions.create(model=client.model, messages=summary, max_tokens=6)
    return float(episode % 3 == 0)


async def test_every_branch_of_an_edited_history_trains_on_policy(tmp_path):
    """Episodes 0 and 2 of each group of 4 fork: 6 trajectories per group, all trained, ratio still 1."""
    import json

    samples = tmp_path / "samples.jsonl"
    results, agent = await _train(tmp_path, "summarising_agent", 2, samples_path=str(samples))
    for r in results:
        m = r.metrics
        assert m["is_ratio_max"] == pytest.approx(1.0, abs=1e-3) and m["is_ratio_min"] == pytest.approx(1.0, abs=1e-3)
        assert m["reward_mean"] == pytest.approx(3 / 6)  # per trained row: episode 0's two branches and episode 3
    trained = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(trained) == 4 and all(s["status"] == "trained" for s in trained)
    # each group: episode 0 (summary 1 turn, then its 2-turn branch), episode 1, episode 2 (1 + 2), episode 3
    assert all(s["turns"] == [1, 2, 2, 1, 2, 2] for s in trained)
    assert agent.loop.counts["http_forks"] >= 4 and agent.loop.counts["http_trajectories"] >= 4 * 6
