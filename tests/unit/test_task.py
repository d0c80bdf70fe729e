"""The built-in addition task, its reward, and the warm-started default model."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from asyncrl.models import default_model_path
from asyncrl.models.tiny import build_tokenizer
from asyncrl.models.warm_start import WarmStartConfig, cache_key
from asyncrl.rollouter.torch_engine import TorchEngine
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


def test_warm_start_cache_mechanics(tmp_path):
    cfg = WarmStartConfig(steps=3, batch_size=8)
    path = default_model_path(tmp_path, config=cfg)
    info = json.loads((path / "warm_start.json").read_text())
    assert info["cache_key"] == cache_key(cfg, ArithmeticTaskConfig()) and path.name.endswith(info["cache_key"])
    assert (path / "config.json").exists() and (path / "tokenizer.json").exists()
    stamp = (path / "warm_start.json").stat().st_mtime_ns
    assert default_model_path(tmp_path, config=cfg) == path  # cached: not rebuilt
    assert (path / "warm_start.json").stat().st_mtime_ns == stamp
    assert default_model_path(tmp_path, config=WarmStartConfig(steps=4, batch_size=8)) != path
    with pytest.raises(ValueError, match="noise"):
        WarmStartConfig(noise=1.0)


@pytest.mark.slow
async def test_default_model_is_partly_right_with_mixed_groups():
    # Default cache (~/.cache/asyncrl or $ASYNCRL_CACHE): about a minute the first time, shared
    # with every other user of default_model_path() afterwards.
    torch.set_num_threads(1)
    path = default_model_path()
    info = json.loads((path / "warm_start.json").read_text())
    assert 0.5 <= info["greedy_reward"] <= 0.95
    assert 0.15 <= info["sampled_reward_t1"] <= 0.5
    tok = build_tokenizer()
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
    assert 0.1 <= rewards.mean() <= 0.6
    assert (rewards.std(1) > 0).mean() >= 0.5
    assert sum(r.finish_reason == "stop" for r in results) >= 0.9 * len(results)  # it learned to end with EOS
