"""A response's outcome is typed and built once (`asyncrl.rollouter.response`): its trajectory is
made when its reward is in, with that reward, so a response with no reward at all fails its group
with one line instead of being trained on a placeholder. An agent loop's run keeps its state in one
`Conversation` record, its LLM adapter none. Real Rollouter, real tiny model engine, simulated replicas."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from asyncrl.agent import AgentLoop
from asyncrl.agent.loop import SingleTurnLoop
from asyncrl.queue.memory import MemorySink
from asyncrl.rollouter.actor import EngineActor
from asyncrl.rollouter.agents import Agent, RolloutLLM
from asyncrl.rollouter.engines.builtin.engine import TorchEngine
from asyncrl.rollouter.partial import PartialBuffer
from asyncrl.rollouter.pool import EnginePool, GroupCalls
from asyncrl.rollouter.response import Conversation, Ended, Response, ResponseOutcome, missing_reward, settle
from asyncrl.rollouter.resumable import Rounds
from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
from asyncrl.rollouter.stats import RolloutStats
from asyncrl.types import GenerateResult, Trajectory
from tests.unit import agent_envs


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the engine runs in this process; the machine's cores are shared


class Branches(AgentLoop):
    """One real turn, returned as an episode of two branches (as an endpoint agent's with
    ``endpoint_branches=all``); ``main`` and ``branch`` are the env rewards each carries."""

    def __init__(self, main: float | None, branch: float | None):
        self.main, self.branch = main, branch

    async def run(self, prompt, llm):
        ep = await SingleTurnLoop(max_tokens=3).run(prompt, llm)
        return [dataclasses.replace(ep, reward=self.main), dataclasses.replace(ep, reward=self.branch)]


async def one_group(model_path, loop: AgentLoop):
    engine = TorchEngine(model_path, eos_token_ids=())
    prompts = [Prompt(text="p0", prompt_ids=np.array([1, 4, 5], dtype=np.int64))]
    r = Rollouter(RolloutConfig(n=1, max_tokens=3, groups_per_sync=100, on_user_error="drop"), [engine], MemorySink(),
                  prompts, lambda p, ids: 0.5 + len(ids), agent=Agent(loop, "test:Branches", branches=True))
    try:
        await asyncio.wait_for(r.run(num_groups=1), 120)
    finally:
        await engine.close()
    (group,) = r.producer.groups
    return group


async def test_a_branch_without_a_reward_fails_its_group_in_one_line(model_path):
    group = await one_group(model_path, Branches(main=1.0, branch=None))
    # Before: the branch got the main's reward written over a 0.0 placeholder and was trained.
    assert group.status == "failed" and not group.complete and group.expected == 1
    assert group.error == ("1: ValueError: sample_0_0[1]: the episode has no reward from its env and none was "
                           "given (pass reward=, the task's reward of its final text)")
    assert "\n" not in group.error


async def test_branches_share_the_task_reward_built_into_each_trajectory(model_path):
    group = await one_group(model_path, Branches(main=None, branch=None))
    assert group.status == "ok" and group.complete and group.expected == 2
    assert [t.index for t in group.trajectories] == [0, 1]
    assert [t.reward for t in group.trajectories] == [3.5, 3.5]  # the main branch's: 0.5 + its 3 tokens


def trajectory(index: int, reward: float | None) -> Trajectory:
    if reward is None:
        raise missing_reward("sample_0_3", index)
    return Trajectory(sample_id="sample_0_3", index=index, prompt_ids=np.array([1]), response_ids=np.array([2]),
                      logprobs=np.zeros(1, np.float32), versions=np.zeros(1, np.int64), finish_reason="stop",
                      reward=reward)


async def test_settle_builds_each_trajectory_once_with_its_reward_and_keeps_errors():
    done = asyncio.get_running_loop().create_future()
    done.set_result(0.25)
    engine_error = RuntimeError("engine out of memory")
    out = await settle([Ended(2, 1, done, trajectory), engine_error, Ended(0, 3, None, trajectory)],
                       lambda exc: AssertionError("no reward raised"))
    first, second, third = out
    assert isinstance(first, ResponseOutcome) and first.replica == 1
    assert first.trajectory.index == 2 and first.trajectory.reward == 0.25
    assert second is engine_error
    assert isinstance(third, ValueError) and str(third).startswith("sample_0_3[0]: the response has no reward")
    with pytest.raises(AttributeError):  # immutable: a named tuple
        first.replica = 0  # never mutated after it is built


async def test_settle_reads_a_done_thread_reward_now_and_awaits_one_still_running():
    import concurrent.futures
    import threading

    done = concurrent.futures.Future()
    done.set_result(1)  # an int from the user's function: taken as a float
    release = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(lambda: release.wait(5) and 0.75)
        asyncio.get_running_loop().call_later(0.05, release.set)
        first, second = await settle([Ended(0, 0, done, trajectory), Ended(1, 0, running, trajectory)],
                                     lambda exc: AssertionError(f"no reward raised: {exc}"))
    assert first.trajectory.reward == 1.0 and type(first.trajectory.reward) is float
    assert second.trajectory.reward == 0.75


async def test_a_reward_that_raises_is_handed_to_reward_error():
    failed = asyncio.get_running_loop().create_future()
    failed.set_exception(ZeroDivisionError("bad reward"))
    (out,) = await settle([Ended(0, 0, failed, trajectory)], lambda exc: RuntimeError(f"user: {exc}"))
    assert isinstance(out, RuntimeError) and str(out) == "user: bad reward"


def test_a_response_record_joins_its_parts_once_and_builds_its_trajectory():
    response = Response("sample_0_5", 1)
    assert response.status == "running" and response.age == 0 and response.replica == -1
    with pytest.raises(RuntimeError, match=r"sample_0_5/1: trajectory\(\) before finish\(\) \(status running\)"):
        response.trajectory(1, 1.0)
    response.parts.add(GenerateResult("sample_0_5/1", np.array([7, 8]), np.array([-0.5, -0.25]), np.array([0, 0]),
                                      "truncated"))
    response.parts.age = 1
    response.parts.add(GenerateResult("sample_0_5/1/1", np.array([9]), np.array([-1.0]), np.array([1]), "truncated"))
    response.prompt_ids = np.array([1, 2, 3])
    ids = response.finish("truncated", replica=3)  # stopped at its budget by a truncation
    assert ids.tolist() == [7, 8, 9] and response.status == "finished" and response.replica == 3
    t = response.trajectory(1, 2.5)
    assert t.finish_reason == "length" and t.age == 1 and t.reward == 2.5 and t.index == 1
    assert t.response_ids.tolist() == [7, 8, 9] and t.versions.tolist() == [0, 0, 1] and t.prompt_ids.tolist() == [1, 2, 3]
    assert t.logprobs.tolist() == [-0.5, -0.25, -1.0]
    with pytest.raises(ValueError, match=r"^sample_0_5\[1\]: the response has no reward"):
        response.trajectory(1, None)
    # A checkpoint saves the record's parts in PartialResponse's layout, as before the record.
    assert response.parts.to_json() == {"age": 1, "response_ids": [7, 8, 9], "logprobs": [-0.5, -0.25, -1.0],
                                        "versions": [0, 0, 1]}


def test_a_response_whose_engine_gave_unequal_token_arrays_fails_in_one_line():
    response = Response("sample_0_6", 0, prompt_ids=np.array([1, 2], dtype=np.int32))
    response.parts.add(GenerateResult("sample_0_6/0", np.array([7, 8]), np.array([-0.5]), np.array([0, 0]), "stop"))
    response.finish("stop", replica=0)
    with pytest.raises(ValueError, match=r"^sample_0_6\[0\]: the engine gave 2 response ids, 1 log-probs and 2 versions"):
        response.trajectory(0, 1.0)
    response.parts.logprobs[0] = np.array([-0.5, -0.25])
    response.finish("stop", replica=0)
    t = response.trajectory(0, 1.0)  # the prompt's ids taken as int64, whatever they came as
    assert t.prompt_ids.dtype == np.int64 and t.prompt_ids.tolist() == [1, 2] and t.logprobs.dtype == np.float32


class EndedSessions(EngineActor):
    """A simulated replica that notes each session ended on it."""

    def __init__(self, **kw):
        super().__init__(kind="sim", **kw)
        self.ended: list[str] = []

    async def end_session(self, session_id):
        self.ended.append(session_id)
        await super().end_session(session_id)


async def test_a_conversation_record_holds_the_runs_state_and_its_adapter_none():
    actors = [EndedSessions(max_running=8, tokens_per_s=4000.0, seed=0) for _ in range(2)]
    pool = EnginePool(actors, timeout_s=30.0)
    pool.load[0] += 100  # replica 0 looks busy: the group goes to replica 1
    calls, record = GroupCalls(pool), Conversation("sample_0_4", 2)
    llm = RolloutLLM(RolloutConfig(n=1, max_tokens=8), Rounds(PartialBuffer(), RolloutStats()), calls, record, seed=11)
    prompt = Prompt(text="p", prompt_ids=np.array([1, 4, 5], dtype=np.int64))
    try:
        episodes = await agent_envs.TwoSessions().run(prompt, llm)
        await llm.end_sessions()
    finally:
        for a in actors:
            await a.close()
    # The turns, sessions, replica and age are the record's; the adapter keeps no copy of them.
    assert record.turns == 2 and record.sessions == ["sample_0_4/2", "sample_0_4/2/s1"]
    assert record.session_id == "sample_0_4/2/s1" and record.replica == 1 and record.age == 0
    assert record.status == "running" and record.parts.n_tokens == len(episodes[1].response_ids)
    assert not {"turns", "sessions", "session_id", "age", "replica", "engine_error"} & set(vars(llm))
    assert llm.turns == 2 and llm.sessions is record.sessions and llm.episode_id == "sample_0_4/2"
    assert actors[1].ended == record.sessions and actors[0].ended == []  # ended where its turns went
    ended = record.finish(episodes, [None, None], first=4)  # a multi-output run: trajectories 4 and 5
    assert record.status == "finished" and record.episodes is episodes and record.parts is None
    assert not record.checkpointed  # a conversation in flight at a crash is generated again from its start
    assert [(e.index, e.replica, e.reward) for e in ended] == [(4, 1, None), (5, 1, None)]
    outcome = ended[1].settle(0.75)
    assert outcome.replica == 1 and outcome.trajectory.index == 5 and outcome.trajectory.reward == 0.75
    assert outcome.trajectory.response_ids.tolist() == episodes[1].response_ids.tolist()
    with pytest.raises(ValueError, match=r"^sample_0_4\[4\]: the episode has no reward"):
        ended[0].settle(None)
