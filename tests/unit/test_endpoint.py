"""The episode endpoint over real HTTP with the real ``openai`` client: OpenAI's schema (tools,
streaming, usage), token-exact histories (echoes mapped to the sampled ids, forks), parallel calls,
each HTTP error, a disconnect aborting its call, and endpoint agents as an `AgentLoop`."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
import numpy as np
import openai
import pytest

from asyncrl.agent.endpoint import ClientSpec, EndpointLoop, EpisodeFailed, EpisodeLimits
from tests.unit.endpoint_helpers import TOK, TOOLS, ScriptedLLM, client, serving

CALL = '<tool_call>{"name": "mul", "arguments": {"a": 6, "b": 7}}</tool_call>'


def full_ids(ep, branch=None):
    b = branch or ep.history.last
    return b.context().tolist()


async def test_a_tool_call_then_an_answer_is_one_exact_trajectory():
    llm = ScriptedLLM([CALL, "It is 42."])
    async with serving(llm) as (server, ep):
        c = client(server, ep)
        msgs = [{"role": "user", "content": "6*7?"}]
        r = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        call = r.choices[0].message.tool_calls[0]
        assert call.id.startswith("call_") and call.function.name == "mul"
        assert json.loads(call.function.arguments) == {"a": 6, "b": 7}
        assert r.usage.prompt_tokens == len(llm.prompts[0]) and r.usage.completion_tokens == len(llm.turns[0])
        msgs += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        r2 = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        assert r2.choices[0].message.content == "It is 42." and r2.choices[0].finish_reason == "stop"
    # The second call's prompt is the first's prompt + its sampled ids + the bridged tool result.
    assert llm.prompts[1][:len(llm.prompts[0]) + len(llm.turns[0])] == llm.prompts[0] + llm.turns[0]
    traj = ep.history.last.trajectory(1.0)
    assert len(ep.history.branches) == 1 and ep.history.forks == 0
    assert traj.prompt_ids.tolist() == llm.prompts[0]
    assert np.concatenate([traj.prompt_ids, traj.response_ids]).tolist() == llm.prompts[1] + llm.turns[1]
    sampled = traj.response_ids[traj.loss_mask == 1].tolist()
    assert sampled == llm.turns[0] + llm.turns[1]  # every sampled token once, nothing else trained
    assert traj.versions[traj.loss_mask == 1].tolist() == [1] * len(llm.turns[0]) + [2] * len(llm.turns[1])
    assert set(traj.versions[traj.loss_mask == 0].tolist()) == {-1}
    assert "<tool_response>\n42\n</tool_response>" in TOK.decode(traj.response_ids.tolist())


@pytest.mark.parametrize("mutate", ["null_content", "parts_content", "respaced_args", "new_ids", "spaces_around"])
async def test_an_echo_altered_by_the_client_maps_to_the_sampled_ids(mutate):
    llm = ScriptedLLM([CALL, "Done."] if mutate != "spaces_around" else ["Sure.", "Done."])
    async with serving(llm) as (server, ep):
        c = client(server, ep)
        msgs = [{"role": "user", "content": "go"}]
        r = await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        echo = r.choices[0].message.model_dump(exclude_none=True)
        if mutate == "null_content":
            echo["content"] = ""
        elif mutate == "parts_content":
            echo["content"] = [{"type": "text", "text": ""}]
        elif mutate == "respaced_args":
            echo["tool_calls"][0]["function"]["arguments"] = json.dumps({"b": 7, "a": 6}, indent=2)
        elif mutate == "new_ids":
            echo["tool_calls"][0]["id"] = "call_client_made"
        else:
            echo["content"] = "  " + echo["content"] + "\n"
        msgs += [echo, {"role": "user", "content": "ok"}]
        await c.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
    assert ep.history.forks == 0 and len(ep.history.branches) == 1
    assert llm.prompts[1][:len(llm.prompts[0]) + len(llm.turns[0])] == llm.prompts[0] + llm.turns[0]


async def test_an_edited_history_forks_and_keeps_the_first_branch_intact():
    llm = ScriptedLLM(["First.", "Second.", "Other."])
    async with serving(llm) as (server, ep):
        c = client(server, ep)
        msgs = [{"role": "user", "content": "a"}]
        r = await c.chat.completions.create(model="policy", messages=msgs)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "b"}]
        await c.chat.completions.create(model="policy", messages=msgs)
        first = full_ids(ep)
        edited = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "Edited."},
                  {"role": "user", "content": "b"}]
        await c.chat.completions.create(model="policy", messages=edited)
    h = ep.history
    assert h.forks == 1 and len(h.branches) == 2 and h.divergences == [(1, edited[1])]
    assert h.branches[0].context().tolist() == first  # never re-tokenized into
    fork = h.branches[1].trajectory(0.0)
    assert fork.prompt_ids.tolist() == llm.prompts[2]
    assert fork.response_ids.tolist() == llm.turns[2] and fork.loss_mask.tolist() == [1] * len(llm.turns[2])


async def test_parallel_calls_of_one_episode_each_get_their_answer():
    gate = asyncio.Event()
    llm = ScriptedLLM(["One.", "Two."], gate=gate)
    async with serving(llm) as (server, ep):
        c = client(server, ep)
        a = asyncio.create_task(c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}]))
        b = asyncio.create_task(c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "y"}]))
        while len(llm.prompts) < 2:
            await asyncio.sleep(0.01)
        gate.set()
        ra, rb = await asyncio.gather(a, b)
    assert {ra.choices[0].message.content, rb.choices[0].message.content} == {"One.", "Two."}
    assert len(ep.history.branches) == 2 and sorted(b.calls for b in ep.history.branches) == [1, 1]


async def test_streaming_gives_openai_chunks_with_tool_call_deltas_and_usage():
    llm = ScriptedLLM(["Let me." + CALL, "42"])
    async with serving(llm) as (server, ep):
        c = client(server, ep)
        stream = await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}], tools=TOOLS,
                                                 stream=True, stream_options={"include_usage": True})
        content, calls, finish, usage = "", [], None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            calls += delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        assert content == "Let me." and finish == "tool_calls" and len(calls) == 1
        assert calls[0].function.name == "mul" and calls[0].id.startswith("call_")
        assert usage.completion_tokens == len(llm.turns[0])
        text = await c.completions.create(model="policy", prompt="12+", stream=True)
        assert "".join([ch.choices[0].text async for ch in text]) == "42"


def test_the_sync_client_and_completions_and_models():
    async def main():
        llm = ScriptedLLM(["Hi.", "7"])
        async with serving(llm) as (server, ep):
            c = client(server, ep, sync=True)
            r = await asyncio.to_thread(c.chat.completions.create, model="x", messages=[{"role": "user", "content": "h"}],
                                        temperature=0.1, top_p=0.5, seed=3)
            assert r.choices[0].message.content == "Hi." and r.model == "policy"
            comp = await asyncio.to_thread(c.completions.create, model="policy", prompt=[5, 6, 7], max_tokens=4)
            assert comp.choices[0].text == "7" and llm.prompts[1] == [5, 6, 7]
            models = await asyncio.to_thread(c.models.list)
            assert [m.id for m in models.data] == ["policy"]

    asyncio.run(main())


async def test_stop_texts_cut_the_answer_and_the_trajectory():
    llm = ScriptedLLM(["abc STOP def"])
    async with serving(llm) as (server, ep):
        r = await client(server, ep).chat.completions.create(model="p", messages=[{"role": "user", "content": "s"}],
                                                              stop=["STOP"])
    assert r.choices[0].message.content == "abc " and r.choices[0].finish_reason == "stop"
    kept = ep.history.last.trajectory(0.0).response_ids.tolist()
    assert TOK.decode(kept) == "abc STOP"  # the token that completed the stop text is the last one kept


async def test_each_http_error():
    llm = ScriptedLLM(["x"] * 8)
    async with serving(llm, EpisodeLimits(max_calls=2, max_context_tokens=200)) as (server, ep):
        c = client(server, ep)
        user = [{"role": "user", "content": "u"}]
        with pytest.raises(openai.AuthenticationError):
            await client(server, ep, key="sk-wrong").chat.completions.create(model="p", messages=user)
        async with httpx.AsyncClient() as h:
            r = await h.post(f"{server.url}/s/nope/v1/chat/completions", json={"messages": user})
            assert r.status_code == 404 and r.headers["x-should-retry"] == "false"
        for kwargs, param in [({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
                              ({"response_format": {"type": "json_object"}}, "response_format"),
                              ({"tool_choice": {"type": "function", "function": {"name": "mul"}}, "tools": TOOLS},
                               "tool_choice")]:
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="p", messages=user, **kwargs)
            assert e.value.body["param"] == param
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="p", messages=[{"role": "user", "content": "y" * 300}])
        assert e.value.body["code"] == "context_length_exceeded"
        await c.chat.completions.create(model="p", messages=user)
        with pytest.raises(openai.BadRequestError) as e:
            await c.chat.completions.create(model="p", messages=user)
        assert e.value.body["code"] == "episode_calls_exceeded" and "rollout.agent.max_turns" in e.value.message
        server.remove(ep, "the agent returned")
        with pytest.raises(openai.ConflictError):
            await c.chat.completions.create(model="p", messages=user)
    assert len(llm.prompts) == 1  # only the one call that was served reached the engine


async def test_a_client_that_disconnects_aborts_its_call():
    gate = asyncio.Event()
    llm = ScriptedLLM(["never"], gate=gate)
    async with serving(llm) as (server, ep):
        c = client(server, ep)
        call = asyncio.create_task(c.chat.completions.create(model="p", messages=[{"role": "user", "content": "u"}]))
        await asyncio.wait_for(llm.started.wait(), 30)
        call.cancel()  # the client goes away: its connection closes
        await asyncio.gather(call, return_exceptions=True)
        for _ in range(500):
            if llm.cancelled:
                break
            await asyncio.sleep(0.01)
    assert llm.cancelled == 1 and ep.history.branches == [] and not ep.in_flight


async def agent_two_calls(row, spec: ClientSpec):
    c = openai.AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0)
    msgs = [{"role": "user", "content": row["prompt"]}]
    r = await c.chat.completions.create(model=spec.model, messages=msgs, tools=TOOLS)
    msgs.append(r.choices[0].message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id, "content": "42"})
    await c.chat.completions.create(model=spec.model, messages=msgs, tools=TOOLS)
    return None if row.get("task_reward") else 0.5


@pytest.mark.parametrize("server", ["loop", "process"])
async def test_a_function_agent_runs_as_an_agent_loop(server):
    loop = EndpointLoop(TOK, function=agent_two_calls, server=server)
    try:
        traj = await loop.run({"prompt": "6*7"}, ScriptedLLM([CALL, "42"]))  # one branch: one trajectory
        assert traj.reward == 0.5 and traj.turns == 2 and traj.final_text == "42"
        none = await loop.run({"prompt": "6*7", "task_reward": True}, ScriptedLLM([CALL, "42"]))
        assert none.reward is None  # the task's reward function scores it
        with pytest.raises(EpisodeFailed, match="it made no call"):
            await EndpointLoop(TOK, function=_no_call).run({"prompt": "p"}, ScriptedLLM())
    finally:
        await loop.aclose()
    assert loop.counts["http_calls"] == 4 and loop.counts["episodes"] == 2
    # one tool call in each episode's first answer, none in its second: counted without a transcript
    assert loop.counts["tool_calls"] == 2 and loop.counts["http_tool_call_turns"] == 2 and loop.counts["turns"] == 4
    from asyncrl.progress import _agent_step_metrics  # the step's tool use, as the Rollouter's stats report it

    step = _agent_step_metrics({}, {f"agent_{k}": v for k, v in loop.counts.items()})
    assert step == {"agent/step_turns": 4.0, "agent/step_tool_calls": 2.0, "agent/tool_calls_per_turn": 0.5}
    assert loop.counts["http_trajectories"] == 2


async def _no_call(row, spec):
    return 1.0


@pytest.mark.parametrize("server", ["loop", "process"])
async def test_an_episode_past_its_wall_time_fails_and_its_call_is_aborted(server, tmp_path):
    """``max_episode_s`` stops the agent (in the episode's own task; with ``process``, in the endpoint's
    process, where it runs) and cancels its call in flight."""
    llm = ScriptedLLM(gate=asyncio.Event())  # the call never finishes
    marker = str(tmp_path / "stopped")  # (written by the agent wherever it runs)

    async def agent(row, spec):
        try:
            c = openai.AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0)
            await c.chat.completions.create(model=spec.model, messages=[{"role": "user", "content": "p"}])
        except asyncio.CancelledError:
            with open(marker, "a") as f:
                f.write(f"{os.getpid()}\n")
            raise

    loop = EndpointLoop(TOK, function=agent, limits=EpisodeLimits(max_episode_s=0.5), server=server)
    try:
        with pytest.raises(EpisodeFailed, match="ran past rollout.agent.endpoint_max_episode_s=0.5"):
            await loop.run({"prompt": "p"}, llm)
        for _ in range(500):  # (with the server in its process, the call's cancel reaches this one over the socket)
            if llm.cancelled:
                break
            await asyncio.sleep(0.01)
        assert llm.cancelled == 1  # by the episode's end, not by the server's close below
    finally:
        await loop.aclose()
    stopped_in = [int(pid) for pid in (tmp_path / "stopped").read_text().split()]
    assert len(stopped_in) == 1 and llm.cancelled == 1 and loop.counts["http_failed_episodes"] == 1
    assert (stopped_in[0] == os.getpid()) == (server == "loop")  # with process, the agent ran in the endpoint's


AGENT_SCRIPT = """
import json, os, sys, urllib.request
row = json.load(sys.stdin)
def post(path, body):
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + path, json.dumps(body).encode(),
        {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))
r = post("/chat/completions", {"model": os.environ["OPENAI_MODEL"], "messages": [{"role": "user", "content": row["prompt"]}]})
mode = row["mode"]
if mode == "post":
    post("/reward", {"reward": 0.25})
elif mode == "print":
    print(r["choices"][0]["message"]["content"]); print("0.75")
elif mode == "fail":
    sys.stderr.write("boom: no luck\\n"); sys.exit(3)
"""


@pytest.mark.parametrize("mode", ["post", "print", "none", "fail"])
async def test_a_command_agent_reward_posted_printed_or_missing(tmp_path, mode):
    script = tmp_path / "agent.py"
    script.write_text(AGENT_SCRIPT)
    loop = EndpointLoop(TOK, command=f"{sys.executable} {script}")
    try:
        if mode in ("post", "print"):
            traj = await loop.run({"prompt": "hi", "mode": mode}, ScriptedLLM(["Hello."]))
            assert traj.reward == {"post": 0.25, "print": 0.75}[mode] and traj.final_text == "Hello."
        else:
            with pytest.raises(EpisodeFailed, match="no reward" if mode == "none" else "exited with code 3: boom"):
                await loop.run({"prompt": "hi", "mode": mode}, ScriptedLLM(["Hello."]))
    finally:
        await loop.aclose()


def not_async(row, client):
    return 1.0


@pytest.mark.parametrize("cfg, message", [
    ({"function": "nowhere_module:agent"}, "module 'nowhere_module' does not import"),
    ({"function": "tests.unit.test_endpoint:missing"}, "has no attribute 'missing'"),
    ({"function": "tests.unit.test_endpoint:not_async"}, "is not an 'async def' function"),
    ({"function": "tests.unit.test_endpoint:_no_call", "command": "python x.py"}, "are both set"),
    ({"command": "no-such-program-xyz --flag"}, "'no-such-program-xyz' is not an executable"),
    ({"command": "python /nonexistent/agent.py"}, "the script '/nonexistent/agent.py' does not exist"),
])
def test_the_launcher_refuses_a_bad_function_or_command_in_one_line(cfg, message):
    from asyncrl.agent import AgentSpecError
    from asyncrl.rollouter.agents import check_agent
    from asyncrl.rollouter.config import AgentConfig

    with pytest.raises((AgentSpecError, ValueError)) as e:
        check_agent(AgentConfig(**cfg), "unused-model-path")
    assert message in str(e.value) and "\n" not in str(e.value)
    good = AgentConfig(function="tests.unit.test_endpoint:agent_two_calls")
    check_agent(good, "unused-model-path")
    assert good.enabled and good.endpoint and good.spec == "rollout.agent.function=tests.unit.test_endpoint:agent_two_calls"


class HangingEngine:
    """An engine whose requests never finish on their own: ``abort`` ends them (and is noted)."""

    def __init__(self):
        self.requests, self.aborted, self.waiting = [], [], {}

    async def generate(self, request, truncatable=False):
        from asyncrl.types import GenerateResult

        self.requests.append(request.request_id)
        done = self.waiting[request.request_id] = asyncio.Event()
        await done.wait()
        return GenerateResult(request.request_id, [], [], [], "abort")

    async def abort(self, request_ids):
        self.aborted.extend(request_ids)
        for rid in request_ids:
            if rid in self.waiting:
                self.waiting[rid].set()

    async def end_session(self, session_id):
        pass


async def gives_up_after_a_moment(row, spec):
    async with httpx.AsyncClient(timeout=httpx.Timeout(1.0)) as h:
        with pytest.raises(httpx.ReadTimeout):  # the client goes away while its call generates
            await h.post(f"{spec.base_url}/chat/completions", headers={"Authorization": f"Bearer {spec.api_key}"},
                         json={"model": spec.model, "messages": [{"role": "user", "content": row["prompt"]}]})
    return 1.0


async def test_through_the_rollouter_a_disconnect_aborts_the_engine_request_and_the_group_fails():
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.agents import build_agent
    from asyncrl.rollouter.config import AgentConfig
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter

    engine = HangingEngine()
    agent = build_agent(AgentConfig(function="tests.unit.test_endpoint:gives_up_after_a_moment"), TOK)
    prompts = [Prompt(text="hi", prompt_ids=np.asarray(TOK.encode("hi"), np.int64))]
    r = Rollouter(RolloutConfig(n=1, engine_calls="ray"), [engine], MemorySink(), prompts, lambda p, ids: 0.0, agent=agent)
    try:
        await asyncio.wait_for(r.run(num_groups=1), 60)
    finally:
        await agent.aclose()
    assert engine.requests == ["sample_0_0/0/t0"] and engine.aborted == ["sample_0_0/0/t0"]
    (group,) = r.producer.groups
    assert group.status == "failed" and "EpisodeFailed" in group.error and "its 1 call(s) ended without an answer" in group.error
