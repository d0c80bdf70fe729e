"""Agent loops through the Rollouter, in-process: a real tiny chat model (`test_agent_loop`'s, trained
in seconds to hold a tool conversation) on the built-in engine behind an `EngineActor`, groups
assembled as in a run. Each response is one run of the loop; every turn a request of the group's
call with its own id, seed and session; the loss mask is 0 exactly on the observations; behaviour
log-probs equal a recompute under the weights of each token's version; failures fail the group.
"""

from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.agent import OBSERVATION_VERSION
from asyncrl.queue.memory import MemorySink
from asyncrl.rollouter.actor import EngineActor
from asyncrl.rollouter.agents import build_agent, last_turn
from asyncrl.rollouter.config import AgentConfig
from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
from tests.unit import agent_envs, test_agent_loop
from tests.unit.test_agent_loop import QUESTION, recompute, render, spans

tok, model_path, ref = test_agent_loop.tok, test_agent_loop.model_path, test_agent_loop.ref  # its fixtures

OBSERVATION = re.compile(r"\n<\|im_start\|>user\n<tool_response>\n.*\n</tool_response><\|im_end\|>\n"
                         r"<\|im_start\|>assistant\n", re.S)


class SpyEngine(EngineActor):
    """The built-in engine's actor, in-process, noting each request and each ended session."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.requests, self.ended, self.results = [], [], {}

    async def generate_group(self, requests, truncatable=False, batch_s=0.0):
        self.requests.extend(requests)
        async for batch in super().generate_group(requests, truncatable, batch_s):
            self.results.update((requests[i].request_id, r) for i, r in batch)
            yield batch

    async def end_session(self, session_id):
        self.ended.append(session_id)
        await super().end_session(session_id)


def prompts(tok, *texts):
    return [Prompt(text=t, prompt_ids=np.asarray(render(tok, [{"role": "user", "content": t}], True)))
            for t in texts]


def env_agent(tok, env: str, **kw):
    return build_agent(AgentConfig(env=f"tests.unit.agent_envs:{env}", max_turns=4, max_tokens_per_turn=80,
                                   max_context_tokens=1024, **kw), tok)


def conversation(tok, t) -> list[dict]:
    """The messages a trajectory holds, read back from its mask: 1-runs are the assistant's, 0-runs tool replies."""
    messages = [{"role": "user", "content": QUESTION}]
    for start, stop in sorted(spans(t.loss_mask, 1) + spans(t.loss_mask, 0)):
        text = tok.decode(t.response_ids[start:stop])
        if t.loss_mask[start]:
            messages.append({"role": "assistant", "content": text.removesuffix("<|im_end|>")})
        else:
            assert OBSERVATION.fullmatch(text), text  # nothing but one tool reply and its markers
            messages.append({"role": "tool", "content": text.split("<tool_response>\n")[1].split("\n</tool_response>")[0]})
    return messages


async def test_a_tool_env_through_the_rollouter(model_path, ref, tok):
    engine = SpyEngine(kind="torch", model_path=str(model_path))
    agent = env_agent(tok, "LookupEnv")
    scored = []

    def reward(prompt, ids):
        scored.append(ids.tolist())
        return float(tok.decode(ids) == "AB CD<|im_end|>")

    r = Rollouter(RolloutConfig(n=3, max_tokens=8, groups_per_sync=100, max_concurrent=2), [engine], MemorySink(),
                  prompts(tok, QUESTION), reward, agent=agent)
    try:
        await asyncio.wait_for(r.run(num_groups=2), 180)
    finally:
        await engine.close()
        agent.close()
    groups = r.producer.groups
    assert len(groups) == 2 and all(g.complete and g.expected == 3 for g in groups), [g.missing() for g in groups]
    trajectories = [t for g in groups for t in g.trajectories]
    assert sum(t.turns for t in trajectories) > len(trajectories)  # tools were called: several turns each
    for t in trajectories:
        model = t.loss_mask == 1
        assert len(spans(t.loss_mask, 1)) == t.turns and t.finish_reason in ("stop", "max_turns")
        # The trajectory is exactly the template's rendering of its conversation, masked 0 exactly on
        # the tool replies with their markers (conversation() checks each 0-run is one reply).
        messages = conversation(tok, t)
        full = render(tok, messages)
        np.testing.assert_array_equal(np.concatenate([t.prompt_ids, t.response_ids]), full[:len(full) - 1])
        np.testing.assert_allclose(t.logprobs[model], recompute(ref, t)[model], atol=1e-4, rtol=0)
        assert (t.logprobs[~model] == 0).all() and (t.versions[~model] == OBSERVATION_VERSION).all()
        assert (t.versions[model] == 0).all()
        assert t.reward == float(messages[-1]["content"] == "AB CD")
    # The task's reward read each episode's last model turn.
    assert sorted(scored) == sorted(last_turn(t.response_ids, t.loss_mask).tolist() for t in trajectories)
    # Each turn one request: its id, the response's session, a seed of its own; every session ended.
    by_id = {q.request_id: q for q in engine.requests}
    for t in trajectories:
        own = [by_id[f"{t.sample_id}/{t.index}/t{j}"] for j in range(t.turns)]
        assert {q.session_id for q in own} == {f"{t.sample_id}/{t.index}"}
        assert len({q.sampling.seed for q in own}) == t.turns
    assert len(engine.requests) == sum(t.turns for t in trajectories)
    assert sorted(engine.ended) == sorted(f"{t.sample_id}/{t.index}" for t in trajectories)
    # The loop's totals, reported as agent/*: every turn answered by the env, a lookup per turn but the last.
    from asyncrl.metrics.report import RolloutReporter

    stats = r.stats_now()
    assert stats["agent_episodes"] == len(trajectories) and stats["agent_turns"] == sum(t.turns for t in trajectories)
    assert stats["agent_tool_calls"] == sum(t.turns - 1 for t in trajectories) and stats["agent_tool_errors"] == 0
    assert stats["agent_env_step_s"] > 0
    values = await RolloutReporter([engine], n=3).poll(r, None)  # the engine's own stats, as a run polls them
    assert values["agent/tool_calls"] == stats["agent_tool_calls"] and values["agent/turns"] == stats["agent_turns"]
    # A step's share: the tool calls per turn the envs answered between two readings.
    from asyncrl.progress import rollouter_step_metrics

    step = rollouter_step_metrics({**stats, "agent_turns": 1, "agent_tool_calls": 0, "agent_env_step_s": 0.0},
                                  {**stats, "waiting_partials": 0, "gate_blocked_s": 0, "credit_blocked_s": 0,
                                   "idle_s": 0, "truncated": 0, "resumed": 0, "timed_out": 0})
    assert step["agent/tool_calls_per_turn"] == stats["agent_tool_calls"] / (stats["agent_turns"] - 1)
    assert step["agent/step_turns"] == stats["agent_turns"] - 1 and step["agent/step_tool_calls"] == stats["agent_tool_calls"]
    assert step["agent/tool_errors_per_call"] == 0 and step["agent/env_step_s_per_turn"] > 0
    # Turns after the first prefill only their new tokens: the engine kept the session's KV (all but
    # the last sampled token of the turn before, which was never fed), on unchanged weights.
    reused = 0
    for t in trajectories:
        for j in range(1, t.turns):
            before, now = by_id[f"{t.sample_id}/{t.index}/t{j - 1}"], by_id[f"{t.sample_id}/{t.index}/t{j}"]
            kept = len(before.prompt_ids) + len(engine.results[before.request_id].response_ids) - 1
            assert engine.results[now.request_id].prefill_tokens == len(now.prompt_ids) - kept, (t.sample_id, j)
            reused += kept
    # The engine's session_* counters, as the reporter reads them: every later turn a hit on its
    # conversation's kept KV, every session ended (none live, none left unused).
    later = sum(t.turns - 1 for t in trajectories)
    assert (values["engine/session_hits"], values["engine/session_tokens_reused"]) == (later, reused)
    assert values["engine/session_live"] == values["engine/session_misses"] == 0
    assert values["engine/session_kept"] >= later


async def test_an_env_that_raises_stops_the_run_naming_the_prompt_or_drops_its_group_and_goes_on(model_path, tok):
    """A user error (`asyncrl.usercode`): ``rollout.on_user_error=stop`` (the default) ends the run
    with the error, the prompt and the user's traceback; ``drop`` sends the group marked, never
    trained, counts it, and the other prompts' groups go on. Sessions are ended either way."""
    from asyncrl.rollouter.agents import AgentLoopError
    from asyncrl.usercode import USER_ERROR_KEY

    engine = SpyEngine(kind="torch", model_path=str(model_path))
    agent = env_agent(tok, "ExplodingEnv")
    line = ("rollout.agent.env=tests.unit.agent_envs:ExplodingEnv raised RuntimeError: env exploded on 'explode now' "
            "(on prompt sample_0_1 'explode now')")
    try:
        r = Rollouter(RolloutConfig(n=2, max_tokens=8, groups_per_sync=100, max_concurrent=1), [engine], MemorySink(),
                      prompts(tok, QUESTION, "explode now"), lambda p, ids: 0.0, agent=agent)
        with pytest.raises(AgentLoopError) as raised:
            await asyncio.wait_for(r.run(num_groups=4), 120)
        assert raised.value.line() == line and "in step\n    raise RuntimeError" in raised.value.user_traceback
        assert [g.sample_id for g in r.producer.groups] == ["sample_0_0"] and r.admitted == 2  # stopped at the 2nd
        assert len(engine.ended) == 4

        r = Rollouter(RolloutConfig(n=2, max_tokens=8, groups_per_sync=100, on_user_error="drop"), [engine],
                      MemorySink(), prompts(tok, QUESTION, "explode now"), lambda p, ids: 0.0, agent=agent)
        await asyncio.wait_for(r.run(num_groups=4), 120)
    finally:
        await engine.close()
        agent.close()
    groups = {g.sample_id: g for g in r.producer.groups}
    assert sorted(groups) == ["sample_0_0", "sample_0_1", "sample_1_2", "sample_1_3"]
    for sid in ("sample_0_1", "sample_1_3"):
        g = groups[sid]
        assert g.status == "failed" and g.trajectories == [] and g.meta[USER_ERROR_KEY] == g.error
        assert g.error == line.replace("sample_0_1", sid)
    assert all(groups[sid].complete for sid in ("sample_0_0", "sample_1_2"))
    assert r.user_errors.dropped == 2 and r.given_back == {"sample_0_1", "sample_1_3"}
    assert len(engine.ended) == 4 + 8  # the sessions of failed conversations are ended too


async def test_a_multi_output_loop_counts_sessions_and_a_missing_one_is_a_user_error(model_path, tok):
    from asyncrl.usercode import USER_ERROR_KEY

    engine = SpyEngine(kind="torch", model_path=str(model_path))
    agent = build_agent(AgentConfig(loop="tests.unit.agent_envs:TwoSessions", sessions=2), tok)
    r = Rollouter(RolloutConfig(n=2, max_tokens=8, groups_per_sync=100, on_user_error="drop"), [engine], MemorySink(),
                  prompts(tok, QUESTION, "drop one"), lambda p, ids: 1.0, agent=agent)
    try:
        await asyncio.wait_for(r.run(num_groups=2), 120)
    finally:
        await engine.close()
    ok, dropped = sorted(r.producer.groups, key=lambda g: g.sample_id)
    assert ok.complete and ok.expected == 4 and sorted(t.index for t in ok.trajectories) == [0, 1, 2, 3]
    assert {q.session_id for q in engine.requests if q.request_id.startswith(ok.sample_id + "/")} == {
        f"{ok.sample_id}/{k}{s}" for k in range(2) for s in ("", "/s1")}
    assert dropped.status == "failed" and not dropped.complete and USER_ERROR_KEY in dropped.meta
    assert dropped.error.startswith(f"{dropped.sample_id}/0: rollout.agent.loop=tests.unit.agent_envs:TwoSessions "
                                    "returned 1 trajectories, rollout.agent.sessions=2 (on prompt ")


async def sync(engine: EngineActor, version: int) -> dict:
    """An in-process weight sync (perturb, pause keeping requests, load, resume); the new weights."""
    sd = engine.engine.model.state_dict()
    gen = torch.Generator().manual_seed(version)
    names = {n for n, _, _ in await engine.param_meta()}
    await engine.pause("keep", clear_cache=True)
    await engine.load_weights([(k, v + 0.01 * torch.randn(v.shape, generator=gen)) for k, v in sd.items() if k in names])
    await engine.finish_weight_update(version)
    await engine.resume()
    return {k: v.clone() for k, v in engine.engine.model.state_dict().items()}


async def test_a_weight_sync_during_a_tool_call_gives_the_next_turn_the_new_version(model_path, tok):
    engine = EngineActor(kind="torch", model_path=str(model_path))
    weights = {0: {k: v.clone() for k, v in engine.engine.model.state_dict().items()}}
    agent = env_agent(tok, "GatedLookupEnv")
    agent_envs.GatedLookupEnv.called, agent_envs.GatedLookupEnv.go = asyncio.Event(), asyncio.Event()
    r = Rollouter(RolloutConfig(n=1, max_tokens=8, groups_per_sync=100), [engine], MemorySink(),
                  prompts(tok, QUESTION), lambda p, ids: 0.0, agent=agent)
    try:
        task = asyncio.create_task(r.run(num_groups=1))
        await asyncio.wait_for(agent_envs.GatedLookupEnv.called.wait(), 60)  # the first turn ended in a tool call
        await r.on_pause()
        weights[1] = await sync(engine, 1)
        await r.on_sync(1)
        agent_envs.GatedLookupEnv.go.set()
        await asyncio.wait_for(task, 120)
    finally:
        await engine.close()
        agent.close()
    (t,) = r.producer.groups[0].trajectories
    turns = spans(t.loss_mask, 1)
    assert len(turns) >= 2
    assert [set(t.versions[a:b].tolist()) for a, b in turns] == [{0}] + [{1}] * (len(turns) - 1)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for version, (a, b) in zip([0] + [1] * (len(turns) - 1), turns):
        model.load_state_dict(weights[version], strict=False)
        np.testing.assert_allclose(t.logprobs[a:b], recompute(model, t)[a:b], atol=1e-4, rtol=0)


async def test_tool_timeout_and_concurrency_from_the_config_bound_the_rollouters_tool_calls(model_path, tok):
    """``rollout.agent.tool_timeout_s`` ends each call of a tool that never returns, as an observation
    the conversation goes on after; ``tool_concurrency`` bounds the calls running at once over all
    the group's conversations (4 ask at once, 2 run)."""
    engine = SpyEngine(kind="torch", model_path=str(model_path))
    agent = env_agent(tok, "HangingLookupEnv", tool_timeout_s=0.3, tool_concurrency=2)
    agent_envs.HangingLookupEnv.running = agent_envs.HangingLookupEnv.most = 0
    r = Rollouter(RolloutConfig(n=4, max_tokens=8, groups_per_sync=100), [engine], MemorySink(),
                  prompts(tok, QUESTION), lambda p, ids: 0.0, agent=agent)
    try:
        await asyncio.wait_for(r.run(num_groups=1), 120)
    finally:
        await engine.close()
        agent.close()
    (g,) = r.producer.groups
    assert g.complete and agent_envs.HangingLookupEnv.most == 2 and agent_envs.HangingLookupEnv.running == 0
    stats = r.stats_now()
    assert stats["agent_tool_calls"] == stats["agent_tool_errors"] >= 4
    for t in g.trajectories:
        assert t.turns >= 2  # the model wrote on after the timed-out call
        first = spans(t.loss_mask, 0)[0]
        assert "timed out after 0.3 s (tool_timeout_s)" in tok.decode(t.response_ids[slice(*first)])


async def test_a_weight_sync_mid_turn_keeps_the_turn_and_its_later_tokens_carry_the_new_version(tmp_path):
    """A sync (pause keep) lands while the long second turn of a conversation is generating: one
    request, kept through the sync, whose first tokens carry version 0 and the rest version 1; no
    token generated twice, each behaviour log-prob a recompute under its own version's weights."""
    from asyncrl.models.tiny import build_tiny_model
    from tests.unit.inprocess import RecordingEngine

    path = build_tiny_model(tmp_path / "m")
    engine = EngineActor(kind="torch", model_path=path, eos_token_ids=(), seed=0)
    weights = {0: {k: v.clone() for k, v in engine.engine.model.state_dict().items()}}
    recording = RecordingEngine(engine)
    agent = build_agent(AgentConfig(loop="tests.unit.agent_envs:LongSecondTurn"), None)
    r = Rollouter(RolloutConfig(n=1, max_tokens=3, groups_per_sync=100), [recording], MemorySink(),
                  [Prompt(text="long", prompt_ids=np.array([1, 4, 5]))], lambda p, ids: 0.0, agent=agent)
    turn = "sample_0_0/0/t1"
    try:
        task = asyncio.create_task(r.run(num_groups=1))
        async with asyncio.timeout(120):
            # Until the second turn runs with a few tokens (the engine hands back after each step
            # while a caller waits, so it cannot run on to its end meanwhile).
            while (before := await engine.wait_for_tokens(turn, 3)) < 3:
                assert turn not in recording.finished, "the second turn ended before the sync"
                await asyncio.sleep(0.001)
        await r.on_pause()
        weights[1] = await sync(engine, 1)
        await r.on_sync(1)
        await asyncio.wait_for(task, 120)
    finally:
        await engine.close()
    (t,) = r.producer.groups[0].trajectories
    assert [q.request_id for q in recording.requests] == ["sample_0_0/0/t0", turn]  # kept, never sent again
    assert len(t.response_ids) == 3 + 2 + 48 and t.finish_reason == "length"  # no token twice, none lost
    second = t.versions[5:].tolist()
    k = second.count(0)
    assert 3 <= before <= k < 48 and second == [0] * k + [1] * (48 - k), second
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for v in (0, 1):
        model.load_state_dict(weights[v], strict=False)
        at = (t.versions == v) & (t.loss_mask == 1)
        np.testing.assert_allclose(t.logprobs[at], recompute(model, t)[at], atol=1e-4, rtol=0)


def test_agent_config_errors_name_the_field():
    with pytest.raises(ValueError, match="set one of them"):
        AgentConfig(env="a:B", loop="c:D")
    with pytest.raises(ValueError, match="sessions=2: only an AgentLoop"):
        AgentConfig(env="a:B", sessions=2)


async def test_partial_rollout_truncates_a_turn_and_the_conversation_resumes_next_round(tmp_path):
    from asyncrl.models.tiny import build_tiny_model
    from asyncrl.rollouter.aggregator import AggregatorActor
    from asyncrl.rollouter.partial import PartialRolloutConfig
    from tests.unit.inprocess import CheckpointWhileTruncated, RecordingEngine, resume_from_checkpoint
    from tests.unit.test_partial_rollout import run_with_syncs

    path = build_tiny_model(tmp_path / "m")
    engines = [EngineActor(kind="torch", model_path=path, eos_token_ids=(), seed=0) for _ in range(2)]
    recordings = [RecordingEngine(e) for e in engines]
    snapshots = {0: {k: v.clone() for k, v in engines[0].engine.model.state_dict().items()}}
    # The synchronous workflow: a round keeps 4 prompts in flight and ends at the step's 2 groups,
    # so the long second turns are stopped mid-turn and resume in the next round.
    partial = PartialRolloutConfig(enable=True, max_age=3, truncate_at="threshold")
    aggregator = AggregatorActor(engines, threshold=partial.resolved_threshold(2, 2))
    agent = build_agent(AgentConfig(loop="tests.unit.agent_envs:LongSecondTurn"), None)
    prompts = [Prompt(text="long" if i % 4 == 0 else "short", prompt_ids=np.array([1, 4 + i % 20, 5]))
               for i in range(40)]
    cfg = RolloutConfig(n=2, max_tokens=3, groups_per_sync=2, staleness_threshold=0.0, max_concurrent=4)
    r = Rollouter(cfg, recordings, MemorySink(), prompts, lambda p, ids: 0.0, partial=partial, aggregator=aggregator,
                  agent=agent)
    check = CheckpointWhileTruncated(recordings)
    try:
        await run_with_syncs(r, engines, r.producer, 8, snapshots, at_pause=check)
        # A checkpoint taken while a truncated turn waited: its conversation is generated again from turn 0.
        again = await resume_from_checkpoint(check, cfg, engines[0], prompts, agent)
    finally:
        for e in engines:
            await e.close()
    assert all(g.complete for g in r.producer.groups) and len(r.producer.groups) == 8
    assert r.stats.truncated >= 1 and r.stats.resumed == r.stats.truncated
    for t in (t for g in again for t in g.trajectories if g.sample_id in check.truncated and t.prompt_ids[1] % 4 == 0):
        assert len(t.response_ids) == 3 + 2 + 48 and t.turns == 2  # the long turn whole, in one go
    resumed = [t for g in r.producer.groups for t in g.trajectories if t.age >= 1]
    # The long second turns are truncated mid-turn (a short one in flight when a round ends may be too).
    long = [t for t in resumed if t.prompt_ids[1] in (4, 8, 12, 16, 20)]
    assert long, [t.prompt_ids.tolist() for t in resumed]
    for t in long:
        assert len(t.response_ids) == 3 + 2 + 48 and t.finish_reason == "length"
        second = t.versions[5:]
        assert len(set(second.tolist())) >= 2 and np.all(np.diff(second) >= 0)  # later tokens, later weights
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    checked = 0
    for t in resumed:
        # Every model token's behaviour log-prob equals a recompute under its own version's weights.
        for v in sorted(set(t.versions[t.loss_mask == 1].tolist())):
            model.load_state_dict(snapshots[v], strict=False)
            at = (t.versions == v) & (t.loss_mask == 1)
            np.testing.assert_allclose(t.logprobs[at], recompute(model, t)[at], atol=1e-4, rtol=0)
            checked += int(at.sum())
    assert checked == sum(int(t.loss_mask.sum()) for t in resumed)


async def test_step_metrics_read_the_versions_of_model_tokens_only():
    from asyncrl.metrics.report import MeteredSource
    from asyncrl.types import Group, Trajectory

    a = np.asarray
    t = Trajectory(sample_id="sample_0_0", index=0, prompt_ids=a([1]), response_ids=a([5, 6, 7, 8]),
                   logprobs=np.zeros(4, np.float32), versions=a([2, -1, -1, 3]), finish_reason="stop",
                   loss_mask=a([1, 0, 0, 1], np.uint8), turns=2)

    class Source:
        async def recv(self, timeout=None):
            return Group(sample_id="sample_0_0", trajectories=[t], expected=1)

    src = MeteredSource(Source())
    await src.recv()
    (sample,) = src.take(["sample_0_0"]).samples
    assert (sample.oldest, sample.span) == (2, 1)  # the observations' -1 is no version


async def test_an_engine_error_in_a_turn_fails_the_group_as_the_engines_not_the_loops(tok):
    class BrokenEngine:
        async def generate(self, request):
            raise RuntimeError("engine out of memory")

    agent = env_agent(tok, "LookupEnv")
    r = Rollouter(RolloutConfig(n=2, max_tokens=8, groups_per_sync=100), [BrokenEngine()], MemorySink(),
                  prompts(tok, QUESTION), lambda p, ids: 0.0, agent=agent)
    try:
        await asyncio.wait_for(r.run(num_groups=1), 60)
    finally:
        agent.close()
    (g,) = r.producer.groups
    assert g.status == "failed" and g.error == "0: RuntimeError: engine out of memory; 1: RuntimeError: engine out of memory"


async def test_a_conversation_in_flight_at_a_checkpoint_is_generated_again_from_its_start(model_path, tok):
    from asyncrl.rollouter.rollouter import RolloutState
    from asyncrl.types import CommittedSet
    from tests.unit.inprocess import snapshot_in_tool_call

    engine = SpyEngine(kind="torch", model_path=str(model_path))
    gated, plain = env_agent(tok, "GatedLookupEnv"), env_agent(tok, "LookupEnv")
    agent_envs.GatedLookupEnv.called, agent_envs.GatedLookupEnv.go = asyncio.Event(), asyncio.Event()
    cfg = RolloutConfig(n=1, max_tokens=8, groups_per_sync=100, seed=5)
    try:
        saved = await snapshot_in_tool_call(cfg, engine, prompts(tok, QUESTION), gated, agent_envs.GatedLookupEnv.called)
        before = list(engine.requests)
        state = RolloutState.resume(saved, CommittedSet(), 0, rows=1)
        again = Rollouter(cfg, [engine], MemorySink(), prompts(tok, QUESTION), lambda p, ids: 0.0, state=state,
                          agent=plain)
        await asyncio.wait_for(again.run(num_groups=1), 120)
    finally:
        await engine.close()
        gated.close()
        plain.close()
    (g,) = again.producer.groups
    assert g.sample_id == "sample_0_0" and g.complete and g.trajectories[0].turns >= 2
    # From its start: the same first request (same ids, same seed) as before the checkpoint, then the rest.
    (t0,) = [q for q in before if q.request_id == "sample_0_0/0/t0"]
    redone = [q for q in engine.requests[len(before):]]
    assert redone[0].request_id == "sample_0_0/0/t0" and np.array_equal(redone[0].prompt_ids, t0.prompt_ids)
    assert redone[0].sampling.seed == t0.sampling.seed and len(redone) == g.trajectories[0].turns
    assert engine.ended == ["sample_0_0/0", "sample_0_0/0"]  # the stopped conversation's session ended too


async def test_the_skip_manager_dumps_and_replays_whole_conversations(model_path, tok, tmp_path):
    from asyncrl.skip import SkipConfig, SkipManager, SkipRoleConfig, is_replayed

    async def once() -> tuple[list, int]:
        SkipManager.init(SkipConfig(experiment="agent", async_rollout=SkipRoleConfig(
            enable=True, dump_dir=str(tmp_path), steps=[0, 1])), shape={"model": str(model_path), "agent": "LookupEnv"})
        engine = SpyEngine(kind="torch", model_path=str(model_path))
        agent = env_agent(tok, "LookupEnv")
        r = Rollouter(RolloutConfig(n=2, max_tokens=8, groups_per_sync=100, seed=1), [engine], MemorySink(),
                      prompts(tok, QUESTION), lambda p, ids: 0.0, agent=agent)
        try:
            await asyncio.wait_for(r.run(num_groups=2), 120)
        finally:
            await engine.close()
            agent.close()
        return sorted(r.producer.groups, key=lambda g: g.sample_id), len(engine.requests)

    try:
        first, requests = await once()
        again, replayed_requests = await once()
    finally:
        SkipManager.init(SkipConfig())
    assert requests >= 2 * 2 * 2 and replayed_requests == 0 and all(map(is_replayed, again))
    for g, h in zip(first, again):
        for t, u in zip(g.trajectories, h.trajectories):
            assert u.turns == t.turns >= 2 and np.array_equal(u.loss_mask, t.loss_mask)
            assert np.array_equal(u.response_ids, t.response_ids) and np.array_equal(u.versions, t.versions)


async def test_validation_runs_the_agent_loop_greedily_and_scores_its_last_turn(model_path, tok, tmp_path):
    import json

    from asyncrl.rollouter.worker import DataSpec, RolloutWorker

    # The worker loads the model's tokenizer itself (asyncrl.models.load_tokenizer): the one it was trained with.
    from asyncrl.models import load_tokenizer

    assert load_tokenizer(model_path).encode(QUESTION) == tok.encode(QUESTION)
    val = tmp_path / "val.jsonl"
    rows = [{"prompt": QUESTION, "data_source": "toy", "reward_model": {"ground_truth": answer}}
            for answer in ("AB CD", "nope")]
    val.write_text("".join(json.dumps(r) + "\n" for r in rows))
    engine = SpyEngine(kind="torch", model_path=str(model_path))
    seen = []
    generate = engine.generate

    async def spy(request, truncatable=False):
        seen.append(request)
        return await generate(request, truncatable)

    engine.generate = spy
    cfg = RolloutConfig(n=2, max_tokens=8, agent=AgentConfig(env="tests.unit.agent_envs:LookupEnv", max_turns=4,
                                                             max_tokens_per_turn=80, max_context_tokens=1024))
    worker = RolloutWorker(cfg, [engine], stream=None, model_path=str(model_path),
                           data_spec=DataSpec(train=str(val), val=str(val), reward="tests.unit.agent_envs:exact_answer"))
    try:
        metrics = await asyncio.wait_for(worker.validate(step=3), 120)
    finally:
        await engine.close()
        worker.agent.close()
    # The trained conversation, replayed greedily: two tool calls, then the answer "AB CD" (the
    # first row's ground truth, not the second's). Each turn a request of its own in the prompt's session.
    assert metrics == {"val/reward_mean": 0.5, "val/response_length_mean": metrics["val/response_length_mean"],
                       "val/samples": 2.0, "val/turns_mean": 3.0}
    assert sorted(q.request_id for q in seen) == [f"val_3_{i}/t{j}" for i in range(2) for j in range(3)]
    assert all(q.sampling.greedy and q.session_id == q.request_id.split("/")[0] for q in seen)
    last = max(seen, key=lambda q: len(q.prompt_ids))  # a conversation's third turn: its whole history as prompt
    assert metrics["val/response_length_mean"] > len(last.prompt_ids) - len(seen[0].prompt_ids)
    assert sorted(engine.ended) == ["val_3_0", "val_3_1"]  # each conversation's KV let go
    assert engine.requests == []  # nothing through training's group calls
    assert worker.feed_state()["next_index"] == 0  # validation never moves the training feed


async def test_a_conversation_generated_again_after_a_resume_gives_its_tool_calls_the_same_keys(model_path, tok):
    """``call_key`` (docs/agent.md): ``{sample_id}/{k}/t{turn}/{i}``, from the conversation's place,
    not from the process; the checkpoint of the first run holds ``sample_0_0`` in flight, as it
    does when a crash lands during the conversation, and the resumed Rollouter generates it again."""
    from asyncrl.rollouter.rollouter import RolloutState
    from asyncrl.types import CommittedSet

    engine = SpyEngine(kind="torch", model_path=str(model_path))
    agent = env_agent(tok, "KeyedLookupEnv")
    cfg = RolloutConfig(n=2, max_tokens=8, groups_per_sync=100, seed=5)
    keys = agent_envs.KeyedLookupEnv.keys
    try:
        first = Rollouter(cfg, [engine], MemorySink(), prompts(tok, QUESTION), lambda p, ids: 0.0, agent=agent)
        await asyncio.wait_for(first.run(num_groups=1), 120)
        before, keys[:] = sorted(keys), []
        saved = {**first.snapshot(), "in_flight": ["sample_0_0"]}  # as a checkpoint taken mid-conversation holds it
        state = RolloutState.resume(saved, CommittedSet(), 0, rows=1)
        again = Rollouter(cfg, [engine], MemorySink(), prompts(tok, QUESTION), lambda p, ids: 0.0, state=state,
                          agent=agent)
        await asyncio.wait_for(again.run(num_groups=1), 120)
    finally:
        await engine.close()
        agent.close()
    (g,) = again.producer.groups
    assert g.sample_id == "sample_0_0"
    calls = sum(t.turns - 1 for t in g.trajectories)  # every turn but the last made one call
    assert calls >= 2 and len(before) == calls, (before, calls)
    assert sorted(keys) == before
    assert set(before) <= {f"sample_0_0/{k}/t{turn}/0" for k in range(2) for turn in range(4)}
