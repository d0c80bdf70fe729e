"""``rollout.agent.endpoint_server: process``: the endpoint in a process of its own. Its calls
generate on the Rollouter's `LLM` over the socket pair; when that process dies mid-episode the
episode fails its group naming the exit code and the next episode starts a new process; it
exits when the Rollouter's end of the socket closes; `aclose` stops it."""

from __future__ import annotations

import asyncio
import os
import signal

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
