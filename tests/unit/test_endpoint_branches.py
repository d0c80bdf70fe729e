"""Every branch of an endpoint episode trained (``rollout.agent.endpoint_branches=all``): an agent
that replaces its history with a summary makes two branches, each its own trajectory with the
episode's reward; the group holds n + 1 trajectories, its advantages are taken per episode, and it
passes the stream's codec, the group filter, the trainer's batch (and an uneven split over ranks)
and a SkipManager dump and replay. Real HTTP, the real ``openai`` client, a scripted engine."""

from __future__ import annotations

import asyncio

import numpy as np
import openai
import pytest
import torch

from asyncrl.agent.endpoint import EndpointLoop
from asyncrl.rollouter.agents import Agent
from asyncrl.types import EPISODES_KEY, GenerateResult, Group, episode_of
from tests.unit.endpoint_helpers import IM_END, TOK, ScriptedLLM


def episode_k(client) -> int:
    """The response index k of this episode (its id is ``{sample_id}-{k}-{hex}``)."""
    return int(client.base_url.split("/s/")[1].split("-")[1])


async def summarising_agent(row, client):
    """Two calls echoing the first answer; episode 0 then replaces its history with a summary (a fork)."""
    c = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
    msgs = [{"role": "user", "content": row["prompt"]}]
    r = await c.chat.completions.create(model=client.model, messages=msgs, max_tokens=8)
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    r = await c.chat.completions.create(model=client.model, messages=msgs, max_tokens=8)
    if episode_k(client) == 0:
        summary = [{"role": "user", "content": "summary: " + (r.choices[0].message.content or "")}]
        await c.chat.completions.create(model=client.model, messages=summary, max_tokens=8)
    return float(episode_k(client))


class ScriptedEngine:
    """Answers every request with ``answer {i}`` + ``<|im_end|>``; keeps each request's prompt and answer."""

    def __init__(self):
        self.seen: dict[str, tuple[list[int], list[int]]] = {}

    async def generate(self, request, truncatable=False):
        ids = TOK.encode(f"answer {len(self.seen)}", add_special_tokens=False) + [IM_END]
        self.seen[request.request_id] = (request.prompt_ids.tolist(), ids)
        n = len(ids)
        return GenerateResult(request.request_id, np.asarray(ids, np.int64), np.full(n, -0.5, np.float32),
                              np.zeros(n, np.int64), "stop")

    async def abort(self, request_ids):
        pass

    async def end_session(self, session_id):
        pass


async def one_group(branches: str, n: int = 3) -> tuple[Group, ScriptedEngine, object]:
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.agents import build_agent
    from asyncrl.rollouter.config import AgentConfig
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter

    engine = ScriptedEngine()
    agent = build_agent(AgentConfig(function="tests.unit.test_endpoint_branches:summarising_agent",
                                    endpoint_branches=branches), TOK)
    prompts = [Prompt(text="hi", prompt_ids=np.asarray(TOK.encode("hi"), np.int64))]
    r = Rollouter(RolloutConfig(n=n, engine_calls="ray"), [engine], MemorySink(), prompts, lambda p, ids: 0.0,
                  agent=agent)
    try:
        await asyncio.wait_for(r.run(num_groups=1), 60)
    finally:
        await agent.aclose()
    (group,) = r.producer.groups
    return group, engine, agent


def whole(t) -> list[int]:
    return t.prompt_ids.tolist() + t.response_ids.tolist()


async def test_an_episode_that_edits_its_history_trains_both_branches_with_episode_advantages():
    from asyncrl.rollouter.filters import GroupView
    from asyncrl.trainer.algorithm import grpo_advantages
    from asyncrl.trainer.batch import assemble, screen_groups

    group, engine, agent = await one_group("all")
    ts = sorted(group.trajectories, key=lambda t: t.index)
    assert group.complete and group.expected == 4 and [t.index for t in ts] == [0, 1, 2, 3]
    assert group.meta[EPISODES_KEY] == [0, 0, 1, 2] == episode_of(group)
    assert [t.reward for t in ts] == [0.0, 0.0, 1.0, 2.0]  # both branches of episode 0 carry its reward
    seen = engine.seen
    # episode 0: its main branch (the summary, its last call) first, then the branch it left
    assert whole(ts[0]) == seen["sample_0_0/0/t2"][0] + seen["sample_0_0/0/t2"][1]
    assert ts[0].prompt_ids.tolist() == seen["sample_0_0/0/t2"][0] and ts[0].turns == 1
    assert ts[1].prompt_ids.tolist() == seen["sample_0_0/0/t0"][0] and ts[1].turns == 2
    assert whole(ts[1]) == seen["sample_0_0/0/t1"][0] + seen["sample_0_0/0/t1"][1]
    assert int(ts[1].loss_mask.sum()) == len(seen["sample_0_0/0/t0"][1]) + len(seen["sample_0_0/0/t1"][1])
    assert agent.loop.counts["http_forks"] == 1 and agent.loop.counts["http_trajectories"] == 4
    kept, dropped = screen_groups([group])
    assert kept == [group] and dropped == []
    assert GroupView.of(group).episodes.tolist() == [0, 0, 1, 2]

    batch = assemble([group])
    per_episode = grpo_advantages(torch.tensor([[0.0, 1.0, 2.0]]))[0]  # three episodes, not four rows
    first = batch["response_mask"].argmax(-1)
    adv = batch["advantages"][torch.arange(4), first]
    assert torch.allclose(adv, per_episode[[0, 0, 1, 2]], atol=1e-5) and adv[0] == pytest.approx(-1.0, abs=1e-4)
    assert batch["rewards"].tolist() == [0.0, 0.0, 1.0, 2.0]
    for i, t in enumerate(ts):  # each row holds its branch's exact tokens, trained where the model wrote them
        real = batch["attention_mask"][i].bool()
        assert batch["input_ids"][i][real].tolist() == whole(t)
        assert int(batch["response_mask"][i].sum()) == t.model_tokens


async def test_the_main_setting_trains_one_branch_per_episode():
    group, engine, agent = await one_group("main")
    ts = sorted(group.trajectories, key=lambda t: t.index)
    assert group.complete and group.expected == 3 and EPISODES_KEY not in group.meta
    assert whole(ts[0]) == engine.seen["sample_0_0/0/t2"][0] + engine.seen["sample_0_0/0/t2"][1]
    assert agent.loop.counts["http_forks"] == 1 and agent.loop.counts["http_trajectories"] == 3


async def test_a_branched_group_crosses_the_stream_and_a_skip_replay_unchanged(tmp_path):
    from asyncrl.queue.group_codec import pack_groups, prepare_group, unpack_groups
    from asyncrl.skip import SkipConfig, SkipManager, SkipRoleConfig, is_replayed
    from asyncrl.trainer.batch import assemble

    frames = pack_groups([prepare_group(g) for g in [(await one_group("all"))[0]]])
    (received,) = unpack_groups([bytes(memoryview(f).cast("B")) for f in frames])
    assert received.expected == 4 and received.meta[EPISODES_KEY] == [0, 0, 1, 2]
    try:
        SkipManager.init(SkipConfig(experiment="branches", async_rollout=SkipRoleConfig(
            enable=True, dump_dir=str(tmp_path), steps=[0])), shape={"agent": "summarising", "endpoint_branches": "all"})
        dumped, _, _ = await one_group("all")
        replayed, engine, _ = await one_group("all")
    finally:
        SkipManager.init(SkipConfig())
    assert is_replayed(replayed) and not engine.seen  # answered from the dump: no request
    assert replayed.expected == 4 and replayed.meta[EPISODES_KEY] == dumped.meta[EPISODES_KEY] == [0, 0, 1, 2]
    assert torch.equal(assemble([replayed])["advantages"], assemble([dumped])["advantages"])


async def test_the_loop_returns_every_branch_main_first():
    llm = ScriptedLLM(["One.", "Two.", "Three."])
    loop = EndpointLoop(TOK, function=summarising_agent)
    llm.episode_id = "sample_0_0/0"
    try:
        main, left = await loop.run({"prompt": "p"}, llm)
        only = await EndpointLoop(TOK, function=summarising_agent, branches="main").run(
            {"prompt": "p"}, ScriptedLLM(["One.", "Two.", "Three."]))
    finally:
        await loop.aclose()
    assert main.reward == left.reward == 0.0 and main.final_text == "Three." and left.final_text == "Two."
    assert main.prompt_ids.tolist() == llm.prompts[2] and left.prompt_ids.tolist() == llm.prompts[0]
    assert only.final_text == "Three."
    # an Agent built by hand (a bench) takes the loop's setting
    assert Agent(loop, "by hand").branches and not Agent(EndpointLoop(TOK, function=summarising_agent,
                                                                      branches="main"), "by hand").branches
    with pytest.raises(ValueError, match="endpoint_branches"):
        EndpointLoop(TOK, function=summarising_agent, branches="some")
