"""The built-in addition task, its reward, and the warm-started default model."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.models import DEFAULT_MODEL_DIR, default_model_path
from asyncrl.models.tiny import TINY_CONFIG, build_tokenizer
from asyncrl.demos.warm_start import (
    DEMO_GREEDY_BAND,
    WarmStartConfig,
    check_demo_band,
    eval_rows,
    evaluate_reward,
    file_sha256,
    warm_start,
)
from asyncrl.rollouter.engines.builtin.engine import TorchEngine
from asyncrl.tasks import ArithmeticTaskConfig, decode_response, encode_prompt, generate_dataset, reward, solve
from asyncrl.types import GenerateRequest, SamplingParams


def test_reward_is_exact_match_up_to_eos():
    assert reward("12+7=", "19") == 1.0
    assert reward("12+7=", " 19 ") == 1.0
    assert reward("12+7=", "19<eos>junk") == 1.0
    assert reward("12+7=", "18") == 0.0
    assert reward("12+7=", "190") == 0.0
    assert reward("12+7=", "") == 0.0
    assert solve("0+0=") == "0"
    with pytest.raises(ValueError, match="a\\+b="):
        reward("12*7=", "84")


def test_dataset_is_seeded_and_well_formed():
    a = generate_dataset(50, seed=3)
    assert a == generate_dataset(50, seed=3) and a != generate_dataset(50, seed=4)
    for row in a:
        assert row["answer"] == solve(row["prompt"]) == row["reward_model"]["ground_truth"]
        x, y = row["prompt"][:-1].split("+")
        assert 0 <= int(x) <= 49 and 0 <= int(y) <= 49
    with pytest.raises(ValueError, match="max_response_tokens"):
        ArithmeticTaskConfig(max_operand=500, max_response_tokens=3)


def test_prompt_encoding_round_trip():
    tok = build_tokenizer()
    ids = encode_prompt(tok, "12+7=")
    assert ids.dtype == np.int64 and ids[0] == tok.bos_token_id and len(ids) == 6
    answer = tok("19", add_special_tokens=False)["input_ids"] + [tok.eos_token_id, 5, 6]
    assert decode_response(tok, answer) == "19"


def test_warm_start_recipe_writes_a_loadable_model_and_its_rewards(tmp_path):
    cfg = WarmStartConfig(steps=3, batch_size=8)
    info = warm_start(tmp_path, config=cfg, task=ArithmeticTaskConfig())
    assert json.loads((tmp_path / "warm_start.json").read_text()) == info
    assert info["settings"]["steps"] == 3 and info["model"] == TINY_CONFIG
    assert info["model_sha256"] == file_sha256(tmp_path / "model.safetensors")
    assert 0.0 <= info["greedy_reward"] <= 1.0 and 0.0 <= info["sampled_reward_t1"] <= 1.0
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.hidden_size == TINY_CONFIG["hidden_size"]
    assert AutoTokenizer.from_pretrained(tmp_path).get_vocab() == build_tokenizer().get_vocab()
    # Three steps from random weights do not make a usable demo policy, and the band check says so.
    assert check_demo_band(info) and "greedy_reward" in check_demo_band(info)[0]
    with pytest.raises(ValueError, match="noise"):
        WarmStartConfig(noise=1.0)


def test_shipped_default_model_is_the_one_its_record_describes():
    path = default_model_path()
    assert path == DEFAULT_MODEL_DIR and path.is_dir()
    info = json.loads((path / "warm_start.json").read_text())
    # The weights are the ones measured (a rebuild updates both), and they fit today's code.
    assert info["model_sha256"] == file_sha256(path / "model.safetensors")
    assert info["model"] == TINY_CONFIG
    assert ArithmeticTaskConfig(**info["task"]) == ArithmeticTaskConfig()  # fields added later at their defaults
    assert AutoTokenizer.from_pretrained(path).get_vocab() == build_tokenizer().get_vocab()
    assert check_demo_band(info) == []


async def test_default_model_is_partly_right_with_mixed_groups():
    # The shipped policy measured here, on this machine's float rounding: its greedy reward is
    # the recorded one and lies in the demo's band; sampled groups mix right and wrong answers.
    torch.set_num_threads(1)
    path = default_model_path()
    info = json.loads((path / "warm_start.json").read_text())
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    task = ArithmeticTaskConfig()
    greedy = evaluate_reward(model, tok, eval_rows(WarmStartConfig(**info["settings"]), task), task, temperature=None)
    assert abs(greedy - info["greedy_reward"]) <= 0.02, (greedy, info["greedy_reward"])
    assert DEMO_GREEDY_BAND[0] <= greedy <= DEMO_GREEDY_BAND[1]
    rows = generate_dataset(32, seed=77)
    engine = TorchEngine(path, max_running=64)
    n = 8
    try:
        results = await asyncio.gather(
            *(
                engine.generate(
                    GenerateRequest(f"{i}_{k}", encode_prompt(tok, r["prompt"]), max_tokens=6, sampling=SamplingParams())
                )
                for i, r in enumerate(rows)
                for k in range(n)
            )
        )
    finally:
        await engine.close()
    rewards = np.array(
        [reward(rows[j // n]["prompt"], decode_response(tok, res.response_ids)) for j, res in enumerate(results)]
    ).reshape(len(rows), n)
    # RL has room to climb, and GRPO has signal: most groups mix right and wrong answers.
    assert 0.15 <= rewards.mean() <= 0.45
    assert (rewards.std(1) > 0).mean() >= 0.5
    assert sum(r.finish_reason == "stop" for r in results) >= 0.9 * len(results)  # it learned to end with EOS
