"""The calculator task (`asyncrl.tasks.calculator`), its shipped model, ``--task calculator``, and a
short in-process run in which the shipped policy learns to call the tool more."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.models import CALCULATOR_MODEL_DIR, default_model_path, load_tokenizer
from asyncrl.demos.calculator import (
    DEMO_SAMPLED_BAND,
    MAX_CONTEXT_TOKENS,
    conversation,
    measure,
)
from asyncrl.demos.warm_start import file_sha256
from asyncrl.tasks.calculator import (
    CalculatorEnv,
    CalculatorTaskConfig,
    ToolLatency,
    evaluate,
    generate_dataset,
    reward,
    solve,
)

CALL = '<tool_call>{"name":"calculator","arguments":{"expression":"%s"}}</tool_call>'


def test_the_reward_is_the_exact_product_of_the_last_turn():
    assert solve("37*48=") == "1776" and solve(" 10 * 99 ") == "990"
    assert reward("37*48=", "1776") == 1.0 and reward("37*48=", " 1776\n") == 1.0
    assert reward("37*48=", "1777") == 0.0 and reward("37*48=", CALL % "37*48") == 0.0
    with pytest.raises(ValueError, match="must look like 'a\\*b='"):
        solve("12+7=")


def test_the_dataset_is_seeded_and_in_range():
    rows = generate_dataset(200, seed=3)
    assert rows == generate_dataset(200, seed=3) and rows != generate_dataset(200, seed=4)
    for r in rows:
        a, b = map(int, r["prompt"].rstrip("=").split("*"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and r["reward_model"]["ground_truth"] == str(a * b)
    with pytest.raises(ValueError, match="min_operand"):
        CalculatorTaskConfig(min_operand=50, max_operand=20)


def test_the_calculator_evaluates_integer_arithmetic_only():
    assert evaluate("37*48") == 1776 and evaluate("(2+3)*-4") == -20 and evaluate(" 7 - 10 ") == -3
    for bad in ("__import__('os')", "2**64", "1/2", "1.5*2", "x*2", "37*"):
        with pytest.raises(ValueError):
            evaluate(bad)
    with pytest.raises(ValueError, match="longer than 64"):
        evaluate("1+" * 40 + "1")


def test_tool_latency_fixed_and_log_normal():
    import random

    assert ToolLatency().draw(random.Random(0)) == 0.0
    assert ToolLatency(median_s=0.3).draw(random.Random(0)) == 0.3
    lat = ToolLatency(median_s=0.2, p99_s=2.0)
    draws = np.array([lat.draw(random.Random(i)) for i in range(4000)])
    assert np.median(draws) == pytest.approx(0.2, rel=0.1)
    assert np.quantile(draws, 0.99) == pytest.approx(2.0, rel=0.3)
    with pytest.raises(ValueError, match="p99_s"):
        ToolLatency(median_s=0.5, p99_s=0.1)
    with pytest.raises(ValueError, match="median_s"):
        ToolLatency(median_s=-1)


async def test_the_env_answers_a_call_after_its_latency_and_reports_errors():
    env = CalculatorEnv(latency_median_s=0.05)
    assert await env.reset("37*48=") == [{"role": "user", "content": "37*48="}]
    t0 = time.perf_counter()
    step = await env.step(CALL % "37*48")
    assert time.perf_counter() - t0 >= 0.045 and env.tool_seconds == pytest.approx(0.05)
    assert step.observation == [{"role": "tool", "name": "calculator", "content": "1776"}] and step.tool_calls == 1
    bad = await env.step(CALL % "37/48")
    assert bad.tool_errors == 1 and "only integers" in bad.observation[0]["content"]
    assert (await env.step("1776")).done
    await env.close()


def test_the_shipped_model_and_its_record():
    assert default_model_path("calculator") == CALCULATOR_MODEL_DIR
    info = json.loads((CALCULATOR_MODEL_DIR / "warm_start.json").read_text())
    assert info["model_sha256"] == file_sha256(CALCULATOR_MODEL_DIR / "model.safetensors")
    lo, hi = DEMO_SAMPLED_BAND
    assert lo <= info["sampled_t1"]["reward"] <= hi
    with pytest.raises(ValueError, match="no built-in task"):
        default_model_path("chess")


def test_a_supervised_conversation_is_what_the_agent_loop_renders():
    from asyncrl.agent.render import ChatRenderer

    tok = load_tokenizer(CALCULATOR_MODEL_DIR)
    renderer, tools = ChatRenderer(tok), CalculatorEnv().tools
    ids, mask = conversation(renderer, tools, "37*48=", "1776", call_tool=True)
    text = tok.decode(ids)
    assert text == ("<|im_start|>system\ntools: calculator<|im_end|>\n<|im_start|>user\n37*48=<|im_end|>\n"
                    "<|im_start|>assistant\n" + CALL % "37*48" + "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
                    "1776\n</tool_response><|im_end|>\n<|im_start|>assistant\n1776<|im_end|>")
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == CALL % "37*48" + "<|im_end|>1776<|im_end|>"
    _, undecided = conversation(renderer, tools, "37*48=", "1776", call_tool=True, decide=False)
    assert sum(mask) - sum(undecided) == 1 and len(ids) < MAX_CONTEXT_TOKENS


def test_the_shipped_model_greedy_calls_the_tool_and_copies_its_result():
    torch.set_num_threads(1)
    got = measure(CALCULATOR_MODEL_DIR, 16, seed=5, greedy=True)
    assert got["tool_calls_per_conversation"] >= 0.9 and got["reward"] >= 0.8, got


def test_task_calculator_sets_its_env_model_and_limits():
    cfg, _ = load_config([], ["data.task=calculator"])
    agent = cfg.rollout.agent
    assert agent.env == "asyncrl.tasks.calculator:CalculatorEnv" and agent.max_turns == 3
    assert agent.kwargs == {"latency_median_s": 0.0, "latency_p99_s": None, "seed": 0}
    assert cfg.model_path == str(CALCULATOR_MODEL_DIR) and cfg.trainer.optim.lr == 5e-5 and cfg.steps == 60
    cfg, _ = load_config([], ["data.task=calculator", "seed=4", "rollout.agent.kwargs.latency_median_s=0.2",
                              "rollout.agent.kwargs.latency_p99_s=2.0", "steps=7"])
    assert cfg.rollout.agent.kwargs == {"latency_median_s": 0.2, "latency_p99_s": 2.0, "seed": 4} and cfg.steps == 7
    cfg, _ = load_config([], ["data.task=calculator", "model.path=/m"])
    assert cfg.trainer.optim.lr == 1e-5  # the task's demo settings are for its own model
    with pytest.raises(ConfigError, match="data.task .*calculator is a built-in task"):
        load_config([], ["data.task=calculator", "data.train=x.jsonl", "data.reward=m:f"])
    with pytest.raises(ConfigError, match="data.long_tail"):
        load_config([], ["data.task=calculator", "data.long_tail=4"])
    with pytest.raises(ConfigError, match="data.task"):
        load_config([], ["data.task=chess"])


def test_task_calculator_with_a_users_own_agent_keeps_its_rows_limits_and_model():
    """``--task calculator rollout.agent.function=...`` (the examples' agents): the task's env and
    its kwargs step aside; its model, limits and reward stay."""
    for own in ("function=examples.openai_agent.agent:run", "command=python examples/command_agent/agent.py"):
        cfg, _ = load_config([], ["data.task=calculator", f"rollout.agent.{own}"])
        agent = cfg.rollout.agent
        assert agent.env is None and agent.kwargs == {} and agent.max_turns == 3 and agent.max_tokens_per_turn == 64
        assert cfg.model_path == str(CALCULATOR_MODEL_DIR) and cfg.trainer.optim.lr == 5e-5
    # A user's own env (the README's calc_env.py): built with its own kwargs, not the task env's.
    cfg, _ = load_config([], ["data.task=calculator", "rollout.agent.env=calc_env:CalcEnv"])
    assert cfg.rollout.agent.env == "calc_env:CalcEnv" and cfg.rollout.agent.kwargs == {}
    assert cfg.rollout.agent.max_turns == 3 and cfg.model_path == str(CALCULATOR_MODEL_DIR)


def test_bad_env_kwargs_are_named_before_ray_starts():
    from asyncrl.agent import AgentSpecError
    from asyncrl.rollouter.agents import check_agent
    from asyncrl.rollouter.config import AgentConfig

    with pytest.raises(AgentSpecError, match=r"CalculatorEnv\(latency_median_s=-1\) fails .*median_s must be >= 0"):
        check_agent(AgentConfig(env="asyncrl.tasks.calculator:CalculatorEnv", kwargs={"latency_median_s": -1}),
                    str(CALCULATOR_MODEL_DIR))
    with pytest.raises(AgentSpecError, match="unexpected keyword"):
        check_agent(AgentConfig(env="asyncrl.tasks.calculator:CalculatorEnv", kwargs={"latency": 1}),
                    str(CALCULATOR_MODEL_DIR))


async def test_the_shipped_policy_learns_to_call_the_tool_in_process(tmp_path, capsys):
    """Ten steps of the Rollouter and a Trainer rank in this process (no Ray) on the task: the
    tool-call rate and the reward rise from the shipped model's; the trained conversations can be
    read back from the run directory with the masked parts marked."""
    from asyncrl.rollouter.agents import build_agent
    from asyncrl.rollouter.config import AgentConfig
    from asyncrl.rollouter.engines.builtin.engine import TorchEngine
    from asyncrl.rollouter.rollouter import RolloutConfig
    from asyncrl.rollouter.worker import DataSpec, load_prompts, make_reward_fn
    from asyncrl.trainer.config import OptimConfig, TrainerConfig, WorkerConfig
    from tests.unit.inprocess import train_steps

    torch.set_num_threads(1)
    path = str(CALCULATOR_MODEL_DIR)
    tok = load_tokenizer(path)
    spec = DataSpec(task="calculator", seed=0)
    prompts, reward_fn = load_prompts(tok, spec)[:256], make_reward_fn(tok, spec)
    agent = build_agent(AgentConfig(env="asyncrl.tasks.calculator:CalculatorEnv", max_turns=3, max_tokens_per_turn=64,
                                    max_context_tokens=256, tool_concurrency=256), tok)
    tcfg = TrainerConfig(worker=WorkerConfig(model_path=path, pad_token_id=tok.pad_token_id,
                                             optim=OptimConfig(lr=1e-4)),
                         groups_per_batch=8, recv_timeout_s=120, transcripts_path=str(tmp_path / "transcripts.jsonl"))
    rcfg = RolloutConfig(n=8, max_tokens=64, groups_per_sync=tcfg.groups_per_sync, staleness_threshold=0.0)
    engine = TorchEngine(path, seed=0)
    results, rollouter, _, _ = await train_steps(tcfg, rcfg, engine, prompts, reward_fn, 10, agent=agent)
    turns = [r.metrics["agent/turns_mean"] for r in results]
    rewards = [r.metrics["reward_mean"] for r in results]
    # Turns per conversation are 1 + tool calls (each call is answered, then the model answers).
    assert np.mean(turns[-3:]) >= np.mean(turns[:3]) + 0.15, turns
    assert np.mean(rewards[-3:]) >= np.mean(rewards[:3]) + 0.1, rewards
    # On-policy (staleness 0, one update a step): each step's multi-turn behaviour log-probs are the
    # trainer's own recompute of the same tokens before its update, so every importance ratio is 1.
    assert max(turns) > 1
    for r in results:
        assert abs(r.metrics["is_ratio_max"] - 1) < 1e-3 and abs(r.metrics["is_ratio_min"] - 1) < 1e-3, r.metrics
    stats = rollouter.stats_now()
    assert stats["agent_tool_calls"] > 0 and stats["agent_tool_errors"] <= 0.15 * stats["agent_tool_calls"]
    agent.close()
    # The run's conversations: one per trained group, decoded with the run's tokenizer.
    from asyncrl.config import to_yaml
    from asyncrl.transcripts import main as transcripts

    (tmp_path / "config.yaml").write_text(to_yaml(load_config([], ["data.task=calculator"])[1]))
    capsys.readouterr()
    assert transcripts([str(tmp_path), "--json", "--last", "0"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(r["sample_id"] for r in shown) == sorted(sid for r in results for sid in r.sample_ids)
    called = [r for r in shown if r["turns"] == 2]
    assert called and all(r["prompt"].endswith("<|im_start|>assistant\n") for r in shown)
    for r in called:  # model, observation (masked), model
        assert [trained for _, trained in r["segments"]] == [True, False, True]
        assert r["segments"][0][0].startswith("<tool_call>") and "<tool_response>" in r["segments"][1][0]
    assert transcripts([str(tmp_path), "--sample", called[0]["sample_id"]]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"== {called[0]['sample_id']}[0]") and "\u27e6" in text and "\u27e7" in text
    assert transcripts([str(tmp_path / "nowhere")]) == 2
