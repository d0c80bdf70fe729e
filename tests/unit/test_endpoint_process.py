"""``rollout.agent.endpoint_server: process``: the endpoint in a process of its own. Its calls
generate on the Rollouter's `LLM` over the socket pair; when that process dies mid-episode the
episode fails its group naming the exit code and the next episode starts a new process; it
exits when the Rollouter's end of the socket closes; `aclose` stops it."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest

from asyncrl.agent.endpoint import EndpointLoop, EpisodeFailed
from asyncrl.agent.endpoint.episode import EpisodeLimits
from asyncrl.agent.endpoint.process import ProcessHost
from tests.unit.endpoint_helpers import RENDERER, TOK, ScriptedLLM


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def one_call(row, spec):
    c = openai.AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0)
    await c.chat.completions.create(model=spec.model, messages=[{"role": "user", "content": row["prompt"]}])
    return 1.0


async def test_a_killed_endpoint_process_fails_its_episodes_and_the_next_runs_on_a_new_one():
    loop = EndpointLoop(TOK, function=one_call, server="process")
    held = ScriptedLLM(gate=asyncio.Event())  # its call stays in flight
    try:
        episode = asyncio.create_task(loop.run({"prompt": "p"}, held))
        await asyncio.wait_for(held.started.wait(), 60)
        first = loop.host.pid
        os.kill(first, signal.SIGKILL)
        with pytest.raises(EpisodeFailed, match=rf"endpoint process \(pid {first}\) exited with code -9"):
            await asyncio.wait_for(episode, 60)
        assert held.cancelled == 1  # its engine request was aborted with it
        traj = await loop.run({"prompt": "again"}, ScriptedLLM(["fine"]))
        assert traj.reward == 1.0 and traj.final_text == "fine" and loop.host.pid != first
        assert loop.counts["http_failed_episodes"] == 1 and loop.counts["episodes"] == 2
    finally:
        await loop.aclose()
    assert _gone(first)


async def pid_as_reward(row, spec):
    await one_call(row, spec)
    if row.get("fail") == "raise":
        raise ValueError("the agent's tool broke")
    return "1.0" if row.get("fail") == "type" else float(os.getpid())


async def test_the_function_agent_runs_in_the_endpoint_process_unless_told_to_run_in_the_callers():
    loop = EndpointLoop(TOK, function=pid_as_reward, server="process", name="tests:pid_as_reward")
    here = EndpointLoop(TOK, function=pid_as_reward, server="process", function_in="caller")
    try:
        traj = await loop.run({"prompt": "p"}, ScriptedLLM(["fine"]))
        assert traj.reward == loop.host.pid != os.getpid() and traj.final_text == "fine"
        with pytest.raises(ValueError, match="the agent's tool broke") as raised:  # as it raised it, with its traceback
            await loop.run({"prompt": "p", "fail": "raise"}, ScriptedLLM(["fine"]))
        assert any('raise ValueError("the agent\'s tool broke")' in note for note in raised.value.__notes__)
        with pytest.raises(TypeError, match="tests:pid_as_reward must return a float reward or None, got str"):
            await loop.run({"prompt": "p", "fail": "type"}, ScriptedLLM(["fine"]))
        assert (await here.run({"prompt": "p"}, ScriptedLLM(["fine"]))).reward == os.getpid()
    finally:
        await loop.aclose()
        await here.aclose()
    with pytest.raises(ValueError, match="function_in must be endpoint or caller, got 'ray'"):
        EndpointLoop(TOK, function=pid_as_reward, function_in="ray")


async def sleeps_blocking(row, spec):
    await one_call(row, spec)
    time.sleep(1.5)  # noqa: ASYNC251 - the point: an agent that blocks its event loop
    return 1.0


@pytest.mark.parametrize("server", ["process", "loop"])
async def test_an_agent_that_blocks_its_loop_holds_up_the_callers_loop_only_with_loop(server):
    loop = EndpointLoop(TOK, function=sleeps_blocking, server=server)
    try:
        await loop.start()
        episode = asyncio.create_task(loop.run({"prompt": "p"}, ScriptedLLM(["fine"])))
        late = 0.0
        while not episode.done():  # this loop's ticks while the agent blocks its own
            t = time.monotonic()
            await asyncio.sleep(0.02)
            late = max(late, time.monotonic() - t - 0.02)
        assert (await episode).reward == 1.0
    finally:
        await loop.aclose()
    assert (late < 0.5) if server == "process" else (late > 1.0)


def test_an_ended_episode_crosses_the_socket_whole():
    """Every field of the record and of its trajectories (arrays as bytes, read back writable)."""
    import dataclasses

    import numpy as np

    from asyncrl.agent.base import AgentTrajectory
    from asyncrl.agent.endpoint.host import EpisodeRecord
    from asyncrl.agent.endpoint.process import _record_in, _record_out

    t = AgentTrajectory(np.arange(3), np.arange(2), np.ones(2, np.uint8), np.full(2, -0.5, np.float32),
                        np.array([4, -1]), "length", 0.25, turns=2, tool_calls=1, tool_errors=1, final_text="hi")
    record = EpisodeRecord("ep-1", 3, 2, 1, 1, 1, [(1, {"role": "user"})], 0.5, "rollout.agent.max_turns", [t, t])
    back = _record_in(_record_out(record))
    assert [getattr(back, f.name) for f in dataclasses.fields(EpisodeRecord) if f.name != "trajectories"] == \
        [getattr(record, f.name) for f in dataclasses.fields(EpisodeRecord) if f.name != "trajectories"]
    assert len(back.trajectories) == 2
    for f in dataclasses.fields(AgentTrajectory):
        got, want = getattr(back.trajectories[1], f.name), getattr(t, f.name)
        if isinstance(want, np.ndarray):
            assert got.dtype == want.dtype and np.array_equal(got, want) and got.flags.writeable, f.name
        else:
            assert got == want, f.name


async def test_the_process_exits_when_its_socket_closes_and_aclose_stops_it():
    host = ProcessHost(RENDERER, EpisodeLimits(), "policy", "127.0.0.1", 0)
    await host.start()
    host.channel.close("the test dropped it")  # as when the Rollouter's process dies: no stop asked
    assert await asyncio.wait_for(host.proc.wait(), 30) == 0
    await host.aclose()
    again = ProcessHost(RENDERER, EpisodeLimits(), "policy", "127.0.0.1", 0)
    await again.start()
    pid = again.pid
    await again.aclose()
    assert again.proc.returncode == 0 and _gone(pid)


def test_the_setting_is_checked_and_reaches_the_loop():
    from asyncrl.agent.endpoint.config import build_endpoint_loop
    from asyncrl.agent.endpoint.host import LoopHost
    from asyncrl.rollouter.config import AgentConfig

    with pytest.raises(ValueError, match="endpoint_server must be process or loop, got 'thread'"):
        AgentConfig(function="tests.unit.test_endpoint_process:one_call", endpoint_server="thread")
    default = build_endpoint_loop(AgentConfig(function="tests.unit.test_endpoint_process:one_call"), TOK)
    on_loop = build_endpoint_loop(AgentConfig(function="tests.unit.test_endpoint_process:one_call",
                                              endpoint_server="loop"), TOK)
    assert isinstance(default.host, ProcessHost) and isinstance(on_loop.host, LoopHost)
    with pytest.raises(ValueError, match="rollout.agent.endpoint_server"):
        EndpointLoop(TOK, function=one_call, server="thread")
