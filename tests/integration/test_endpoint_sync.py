"""A weight sync in the middle of an endpoint call: the call is paused and kept (its client only
waits), its tokens carry the version that wrote each (old, then new; none twice), the next call is
generated on the new weights, and every token's behaviour log-prob is the recompute under its own
version's weights. The Rollouter, the built-in engine and a tiny random chat model, in-process."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

CALL_TOKENS = 40
answers: list = []


async def two_calls(row, client):
    import openai

    c = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
    msgs = [{"role": "user", "content": row["prompt"]}]
    for k in range(2):
        r = await c.chat.completions.create(model=client.model, messages=msgs, max_tokens=CALL_TOKENS)
        answers.append(r)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
    return 1.0


async def sync(engine, version: int) -> dict:
    """An in-process weight sync (perturb, pause keeping requests, re-prefill, resume); the new weights."""
    sd = engine.engine.model.state_dict()
    gen = torch.Generator().manual_seed(version)
    names = {n for n, _, _ in await engine.param_meta()}
    await engine.pause("keep", clear_cache=True)
    await engine.load_weights([(k, v + 0.01 * torch.randn(v.shape, generator=gen)) for k, v in sd.items() if k in names])
    await engine.finish_weight_update(version)
    await engine.resume()
    return {k: v.clone() for k, v in engine.engine.model.state_dict().items()}


def spans(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


async def test_a_sync_mid_call_keeps_the_call_and_versions_its_tokens(tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncrl.models.tiny_chat import build_chat_model
    from asyncrl.models import load_tokenizer
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.actor import EngineActor
    from asyncrl.agent.endpoint import EndpointLoop, EpisodeLimits
    from asyncrl.agent.render import ChatRenderer
    from asyncrl.rollouter.agents import Agent
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
    from asyncrl.trainer.algorithm import token_logprobs

    torch.set_num_threads(1)
    path = build_chat_model(tmp_path / "model")
    tok = load_tokenizer(str(path))
    engine = EngineActor(kind="torch", model_path=str(path), eos_token_ids=())  # only the end-of-turn id stops
    weights = {0: {k: v.clone() for k, v in engine.engine.model.state_dict().items()}}
    # A random model ends its turn at once: turns here stop only at their budget, so a sync lands mid-call.
    renderer = ChatRenderer(tok)
    renderer.stop_ids = ()
    agent = Agent(EndpointLoop(tok, function=two_calls, renderer=renderer, limits=EpisodeLimits(
        max_calls=2, max_tokens_per_call=CALL_TOKENS, max_context_tokens=512)), "two_calls")
    r = Rollouter(RolloutConfig(n=1, max_tokens=8, groups_per_sync=100), [engine], MemorySink(),
                  [Prompt(text="hi", prompt_ids=np.asarray(tok.encode("hi"), np.int64))], lambda p, ids: 0.0, agent=agent)
    answers.clear()
    try:
        task = asyncio.create_task(r.run(num_groups=1))
        deadline = asyncio.get_running_loop().time() + 60
        while await engine.engine.wait_for_tokens("sample_0_0/0/t0", 3) < 3:  # (0: not sent yet)
            assert asyncio.get_running_loop().time() < deadline and not answers, "the first call was not caught mid-way"
            await asyncio.sleep(0.005)
        await r.on_pause()
        weights[1] = await sync(engine, 1)
        await r.on_sync(1)
        await asyncio.wait_for(task, 120)
    finally:
        await engine.close()
        await agent.aclose()
    (t,) = r.producer.groups[0].trajectories
    first, second = spans(t.loss_mask == 1)
    v = t.versions
    assert answers[0].usage.completion_tokens == first[1] - first[0] == CALL_TOKENS  # none generated twice
    k = int((v[first[0]:first[1]] == 0).sum())
    assert 3 <= k < first[1] - first[0], k
    assert v[first[0]:first[1]].tolist() == [0] * k + [1] * (first[1] - first[0] - k)  # old weights, then new
    assert set(v[second[0]:second[1]].tolist()) == {1}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([t.prompt_ids.tolist() + t.response_ids.tolist()])
    for version in (0, 1):
        model.load_state_dict(weights[version], strict=False)
        with torch.no_grad():
            want = token_logprobs(model(ids).logits, ids, 1.0)[0][len(t.prompt_ids):].numpy()
        at = (t.loss_mask == 1) & (v == version)
        np.testing.assert_allclose(t.logprobs[at], want[at], atol=1e-4, rtol=0)
