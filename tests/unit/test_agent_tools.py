"""@tool schemas, the Hermes parser and ToolEnv's calls: output or error, never the episode's end."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from asyncrl.agent import HermesParser, Step, ToolDefinitionError, ToolEnv, tool


def call(name, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@tool
def add(a: int, b: int = 1) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


@tool(name="shout")
async def shout_async(text: str) -> str:
    """Upper-case a text.

    Args:
        text: what to shout
    """
    await asyncio.sleep(0)
    return text.upper()


def test_schema_from_hints_and_docstring():
    assert add.schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "required": ["a"], "properties": {
            "a": {"type": "integer", "description": "the first"},
            "b": {"type": "integer", "description": "the second"}}}}}
    assert (add.is_async, shout_async.is_async) == (False, True)
    assert shout_async.name == shout_async.schema["function"]["name"] == "shout"


def test_untyped_or_undocumented_functions_are_refused_naming_function_and_parameter():
    def lookup(key, limit: int):
        """Look up.

        Args:
            key: k
            limit: n
        """

    with pytest.raises(ToolDefinitionError, match=r"lookup: parameter 'key' has no type hint"):
        tool(lookup)

    def nodoc(key: str):
        return key

    with pytest.raises(ToolDefinitionError, match=r"nodoc.*no docstring"):
        tool(nodoc)

    def varargs(*keys: str):
        """V.

        Args:
            keys: k
        """

    with pytest.raises(ToolDefinitionError, match=r"varargs: parameter 'keys' is \*args"):
        tool(varargs)


def test_hermes_parser():
    p = HermesParser()
    calls = p.parse("thinking " + call("add", a=2) + " and " + call("shout", text="x") + " done")
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 2}, None), ("shout", {"text": "x"}, None)]
    assert p.parse("the answer is 4") == []
    bad = p.parse('<tool_call>{"name": "add", "arguments": {"a": </tool_call>')
    assert len(bad) == 1 and bad[0].name is None and "malformed tool call JSON" in bad[0].error
    assert "must be" in p.parse('<tool_call>["add"]</tool_call>')[0].error
    # arguments as a JSON string, and a block cut short by the token budget
    assert p.parse('<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>')[0].arguments == {"a": 5}
    assert p.parse('<tool_call>{"name": "add", "arguments": {"a": 1}}')[0].arguments == {"a": 1}


async def test_tool_env_answers_every_call_in_order():
    env = ToolEnv([add, shout_async])
    try:
        assert env.tools == (add.schema, shout_async.schema)
        assert await env.reset("hi") == [{"role": "user", "content": "hi"}]
        step = await env.step(call("add", a=2, b=3) + call("shout", text="ok"))
        assert step == Step(observation=[{"role": "tool", "name": "add", "content": "5"},
                                         {"role": "tool", "name": "shout", "content": "OK"}],
                            tool_calls=2, tool_errors=0)
        final = await env.step("It is 5.")
        assert final.done and final.observation == [] and final.tool_calls == 0
    finally:
        await env.close()


RELEASE = threading.Event()
"""What the slow tools wait for: set only after the step returned (so a step that returned was ended
by its deadline, however loaded the machine)."""


def _slow_sync(key: str) -> str:
    """Sleep.

    Args:
        key: k
    """
    RELEASE.wait(60)
    return key


async def _slow_async(key: str) -> str:
    """Sleep.

    Args:
        key: k
    """
    await asyncio.Event().wait()  # never set: only the deadline ends it
    return key


def _raises(key: str) -> str:
    """Fail.

    Args:
        key: k
    """
    raise KeyError(key)


async def _returns_bytes(key: str) -> str:
    """Bytes.

    Args:
        key: k
    """
    return key.encode()


@pytest.mark.parametrize("fn, error", [
    (_raises, "Error: tool 'f' raised KeyError: 'x'"),
    (_slow_sync, "Error: tool 'f' timed out after 0.2 s (tool_timeout_s)"),
    (_slow_async, "Error: tool 'f' timed out after 0.2 s (tool_timeout_s)"),
    (_returns_bytes, "Error: tool 'f' returned bytes; a tool must return text (str) or a JSON value"),
])
async def test_a_failing_call_is_an_error_observation(fn, error):
    env = ToolEnv([tool(fn, name="f"), add], tool_timeout_s=0.2)
    RELEASE.clear()
    try:
        # The slow tools end only once RELEASE is set, after this returns: the deadline ended them.
        step = await asyncio.wait_for(env.step(call("f", key="x") + call("add", a=1)), 30)
        assert [m["content"] for m in step.observation] == [error, "2"]
        assert (step.done, step.tool_calls, step.tool_errors) == (False, 2, 1)
    finally:
        RELEASE.set()
        await env.close()


async def test_unknown_tool_malformed_json_and_bad_arguments():
    env = ToolEnv([add])
    try:
        step = await env.step(call("nope") + "<tool_call>{oops</tool_call>" + call("add", b=2)
                              + call("add", a="two"))
        texts = [m["content"] for m in step.observation]
        assert texts[0] == "Error: unknown tool 'nope'; available: add"
        assert texts[1].startswith("Error: malformed tool call JSON")
        assert texts[2].startswith("Error: bad arguments for 'add': missing a required argument: 'a'")
        assert texts[3] == "Error: argument 'a' of 'add' must be integer, got str"
        assert (step.tool_calls, step.tool_errors) == (4, 4)
    finally:
        await env.close()


async def test_sync_tools_on_threads_run_on_the_bounded_pool_and_calls_are_bounded():
    lock = threading.Lock()
    running, peak, threads = 0, 0, set()

    def work(key: str) -> str:
        """Work.

        Args:
            key: k
        """
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
            threads.add(threading.current_thread().name)
        time.sleep(0.05)
        with lock:
            running -= 1
        return key

    env = ToolEnv([work], tool_concurrency=2, sync_tools="thread")  # threads: the tool's state is shared in-process
    try:
        step = await env.step("".join(call("work", key=str(i)) for i in range(6)))
    finally:
        await env.close()
    assert [m["content"] for m in step.observation] == [str(i) for i in range(6)]
    assert peak == 2
    assert threads and all(name.startswith("asyncrl-tool") for name in threads)


async def test_async_tools_of_one_turn_run_concurrently():
    barrier = asyncio.Barrier(3)

    async def meet(key: str) -> str:
        """Meet.

        Args:
            key: k
        """
        await barrier.wait()  # returns only once all three calls are running at the same time
        return key

    env = ToolEnv([meet], tool_timeout_s=5)
    try:
        step = await env.step("".join(call("meet", key=k) for k in "abc"))
    finally:
        await env.close()
    assert [m["content"] for m in step.observation] == ["a", "b", "c"] and step.tool_errors == 0
