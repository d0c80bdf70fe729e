"""Sync tools in worker processes (`ToolRunner`, ``sync_tools="process"``): a tool that never
returns ends only its call (its worker is killed at the timeout), later calls keep their latency,
and the process exits; what such a tool may not do; each call's key (``call_key``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from asyncrl.agent import Step, ToolEnv, tool
from asyncrl.agent.tool_env import ToolRunner, ToolRunnerConfig

HUNG = textwrap.dedent('''
    import asyncio, json, sys, threading, time
    from asyncrl.agent import ToolEnv, tool
    from asyncrl.agent.tool_env import ToolRunner, ToolRunnerConfig

    def hang(key: str) -> str:
        """Never returns.

        Args:
            key: k
        """
        threading.Event().wait()

    def double(n: int) -> int:
        """Twice n.

        Args:
            n: a number
        """
        return 2 * n

    def call(name, **arguments):
        return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"

    async def main():
        runner = ToolRunner(ToolRunnerConfig(tool_timeout_s=0.5, tool_concurrency=100,
                                             sync_tools=sys.argv[1], sync_tool_workers=20))
        env = ToolEnv([hang, double], runner=runner)
        hung = await env.step("".join(call("hang", key=str(i)) for i in range(100)))
        t0 = time.perf_counter()
        fast = await env.step(call("double", n=21))
        fast_s = time.perf_counter() - t0
        print(json.dumps({"hung": [m["content"] for m in hung.observation], "fast": fast.observation[0]["content"],
                          "fast_s": fast_s, "killed": runner.killed}), flush=True)
        runner.close()

    asyncio.run(main())
    print("exiting", time.time(), flush=True)
''')


def test_100_hung_sync_calls_end_only_themselves_a_fast_call_answers_and_the_process_exits(tmp_path):
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    done = subprocess.run([sys.executable, str(script), "process"], capture_output=True, text=True, timeout=120)
    exited = time.time()
    assert done.returncode == 0, done.stderr[-3000:]
    report, exiting = done.stdout.strip().splitlines()
    out = json.loads(report)
    assert out["hung"] == ["Error: tool 'hang' timed out after 0.5 s (tool_timeout_s)"] * 100
    assert out["killed"] == 100  # each hung call's worker was killed, not left holding a slot
    # The fast call after them is answered within its deadline, not timed out: on threads
    # (sync_tools="thread") the 100 hung calls hold every thread for good, so it can only time out,
    # and the process cannot exit (its pool's threads are joined at exit).
    assert out["fast"] == "42"
    assert exited - float(exiting.split()[1]) < 10  # exits in seconds: no hung worker is joined


def test_a_sync_tool_that_does_not_pickle_is_the_users_error_naming_the_way_out():
    lock = threading.Lock()

    def locked(key: str) -> str:
        """Uses a lock of this process.

        Args:
            key: k
        """
        with lock:
            return key

    env = ToolEnv([locked])
    import asyncio

    async def go():
        try:
            await env.step('<tool_call>{"name": "locked", "arguments": {"key": "a"}}</tool_call>')
        finally:
            await env.close()

    with pytest.raises(TypeError, match=r"sync tool 'locked' cannot run in a worker process: it does not pickle "
                                        r"\(TypeError: cannot pickle '_thread.lock' object\); make it async, or use "
                                        r"sync_tools='thread'"):
        asyncio.run(go())


def _call(name, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.mark.parametrize("sync_tools", ["process", "thread"])
async def test_each_call_gets_its_key_and_the_model_never_sees_or_sets_it(sync_tools):
    @tool
    def book(room: str, call_key: str) -> str:
        """Book a room once per call key.

        Args:
            room: the room
        """
        return f"{room}@{call_key}"

    @tool
    async def note(text: str, call_key: str) -> str:
        """Note a text.

        Args:
            text: the text
        """
        return f"{text}@{call_key}"

    assert book.wants_call_key and "call_key" not in json.dumps(book.schema)
    assert book.schema["function"]["parameters"]["required"] == ["room"]
    env = ToolEnv([book, note], sync_tools=sync_tools)
    env.episode_id = "sample_0_7/3"  # what the loop sets in a run
    try:
        first = await env.step(_call("book", room="a") + _call("note", text="b"))
        second = await env.step(_call("book", room="c") + _call("book", room="d", call_key="mine"))
        last = await env.step("done")
    finally:
        await env.close()
    assert [m["content"] for m in first.observation] == ["a@sample_0_7/3/t0/0", "b@sample_0_7/3/t0/1"]
    assert [m["content"] for m in second.observation] == [
        "c@sample_0_7/3/t1/0", "Error: bad arguments for 'book': got an unexpected keyword argument 'call_key'"]
    assert last == Step(observation=[], done=True)
