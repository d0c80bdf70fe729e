"""Endpoint agents across a resume, in process (the whole-process crash and resume:
tests/integration/test_endpoint_resume.py): every run of an episode gets the same ``episode_key``
(``{sample_id}/{k}``) and a new URL and secret; a Rollouter resumed from the snapshot a checkpoint
takes while episodes wait between their calls runs them again from their first call, over real
HTTP with the real ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import openai
import pytest

from asyncrl.agent.endpoint import ClientSpec, EndpointLoop
from tests.unit.endpoint_helpers import TOK, ScriptedLLM

KEYED: list[tuple[str, str, str]] = []


async def keyed_agent(row, spec: ClientSpec):
    KEYED.append((spec.episode_key, spec.base_url, spec.api_key))
    c = openai.AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0)
    await c.chat.completions.create(model=spec.model, messages=[{"role": "user", "content": row["prompt"]}])
    return 1.0


KEY_SCRIPT = """
import json, os, sys, urllib.request
row = json.load(sys.stdin)
open(row["out"], "w").write(os.environ["ASYNCRL_EPISODE_KEY"])
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", json.dumps({"model": "m",
    "messages": [{"role": "user", "content": "hi"}]}).encode(), {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
    "Content-Type": "application/json"})
urllib.request.urlopen(req)
print("1.0")
"""


async def test_every_run_of_an_episode_gets_the_same_episode_key_and_a_new_url_and_secret(tmp_path):
    # (as after a resume: the Rollouter runs sample_0_0's episode 0 again; docs/endpoint.md)
    KEYED.clear()
    loop = EndpointLoop(TOK, function=keyed_agent)
    script = tmp_path / "agent.py"
    script.write_text(KEY_SCRIPT)
    command = EndpointLoop(TOK, command=f"{sys.executable} {script}")
    try:
        for _ in range(2):
            await loop.run({"prompt": "hi"}, ScriptedLLM(["ok"]))  # its episode_id: sample_0_0/0
        await command.run({"prompt": "hi", "out": str(tmp_path / "key")}, ScriptedLLM(["ok"]))
        outside_run = ScriptedLLM(["ok"])
        outside_run.episode_id = None
        outside = await loop.run({"prompt": "hi"}, outside_run)
    finally:
        await loop.aclose()
        await command.aclose()
    (k1, url1, key1), (k2, url2, key2), (k3, url3, _) = KEYED
    assert k1 == k2 == "sample_0_0/0" and url1 != url2 and key1 != key2
    assert (tmp_path / "key").read_text() == "sample_0_0/0"
    assert outside.reward == 1.0 and k3 == url3.split("/s/")[1].removesuffix("/v1")  # outside a run: unique


class FixedEngine:
    """Answers every request with the same text at ``version`` (its requests noted by id)."""

    def __init__(self):
        self.requests, self.version = [], 0

    async def generate(self, request, truncatable=False):
        from asyncrl.types import GenerateResult

        self.requests.append(request.request_id)
        ids = np.asarray(TOK.encode("ok", add_special_tokens=False) + [TOK.convert_tokens_to_ids("<|im_end|>")])
        return GenerateResult(request.request_id, ids, np.full(len(ids), -0.1, np.float32),
                              np.full(len(ids), self.version), "stop")

    async def abort(self, request_ids):
        pass

    async def end_session(self, session_id):
        pass


HOLD: dict = {"gate": None, "held": set(), "runs": []}


async def held_agent(row, spec: ClientSpec):
    """Two echoed calls; while ``HOLD["gate"]`` is set it waits between them (as in a slow tool)."""
    HOLD["runs"].append((spec.episode_key, spec.base_url, spec.api_key))
    c = openai.AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0)
    msgs = [{"role": "user", "content": row["prompt"]}]
    r = await c.chat.completions.create(model=spec.model, messages=msgs)
    if HOLD["gate"] is not None:
        HOLD["held"].add(spec.episode_key)
        await HOLD["gate"].wait()
    msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    await c.chat.completions.create(model=spec.model, messages=msgs)
    return 1.0


async def test_a_resume_runs_the_episodes_in_flight_at_the_checkpoint_again_from_their_start():
    """In process (the slow, whole-process version: tests/integration/test_endpoint_resume.py): the
    snapshot a checkpoint takes while both episodes wait between their calls lists their group in
    flight; after `RolloutState.resume` the agent runs again for each, from its first call."""
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.agents import build_agent
    from asyncrl.rollouter.config import AgentConfig
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter, RolloutState
    from asyncrl.types import CommittedSet

    engine = FixedEngine()
    # (the endpoint and the agent on this loop: the agent waits on this process's HOLD gate)
    agent = build_agent(AgentConfig(function="tests.unit.test_endpoint_resume:held_agent", endpoint_server="loop"), TOK)
    prompts = [Prompt(text="hi", prompt_ids=np.asarray(TOK.encode("hi"), np.int64))]
    cfg = RolloutConfig(n=2, engine_calls="ray")
    HOLD.update(gate=asyncio.Event(), held=set(), runs=[])
    try:
        first = Rollouter(cfg, [engine], MemorySink(), prompts, lambda p, ids: 0.0, agent=agent)
        task = asyncio.create_task(first.run(num_groups=1))
        for _ in range(1000):
            if len(HOLD["held"]) == 2 or task.done():
                break
            await asyncio.sleep(0.01)
        saved = json.loads(json.dumps(first.snapshot()))  # what the checkpoint stores
        await first.stop()
        await asyncio.wait_for(task, 30)
        before, old = list(engine.requests), list(HOLD["runs"])
        assert saved["in_flight"] == ["sample_0_0"] and saved["partials"] == {} and first.producer.groups == []
        for _, url, key in old:  # the interrupted episodes' URL and key open nothing any more
            with pytest.raises(openai.ConflictError, match="has ended"):
                await openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0).chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "hi"}])
        HOLD["gate"], engine.version = None, 1  # (the resumed engines serve newer weights)
        state = RolloutState.resume(saved, CommittedSet(), 0, rows=1)
        again = Rollouter(cfg, [engine], MemorySink(), prompts, lambda p, ids: 0.0, state=state, agent=agent)
        await asyncio.wait_for(again.run(num_groups=1), 30)
    finally:
        HOLD["gate"] = None
        await agent.aclose()
    assert sorted(before) == ["sample_0_0/0/t0", "sample_0_0/1/t0"]
    assert sorted(engine.requests[len(before):]) == [f"sample_0_0/{k}/t{t}" for k in range(2) for t in range(2)]
    new = HOLD["runs"][len(old):]
    assert sorted(k for k, _, _ in old) == sorted(k for k, _, _ in new) == ["sample_0_0/0", "sample_0_0/1"]
    assert not {url for _, url, _ in old} & {url for _, url, _ in new}
    (g,) = again.producer.groups
    assert g.sample_id == "sample_0_0" and g.status == "ok" and len(g.trajectories) == 2
    for t in g.trajectories:  # both calls of the new run, every sampled token from it (version 1)
        assert t.turns == 2 and set(t.versions[t.loss_mask == 1].tolist()) == {1}
