"""`ToolEnv`: an `Env` whose replies are tool results.

Each model turn is parsed for tool calls (`HermesParser` by default). A turn without a call is
the final answer: the episode ends (``done``; the task's reward function scores it unless a
subclass sets a reward). Otherwise every call runs, off the event loop, and the observation is
one ``role="tool"`` message per call, in order, holding its output or its error:

- sync tools run on the `ToolRunner`'s bounded thread pool, async tools as tasks on the loop;
- every call runs under ``tool_timeout_s`` and at most ``max_concurrent`` run at once;
- a tool that raises, outlives its timeout or returns something that is not text, an unknown
  tool name, malformed JSON, bad arguments: each gives an error observation for that call and
  the conversation goes on.

A sync tool that hangs keeps its pool thread busy after its timeout (Python cannot stop a
thread); the pool's size bounds how many can. An async tool that blocks the loop (e.g.
``time.sleep`` inside ``async def``) cannot be timed out: write it with ``await``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from asyncrl.agent.base import Env, Message, Step
from asyncrl.agent.parsers import HermesParser, ToolCall, ToolCallParser
from asyncrl.agent.tools import Tool, ToolCallError, as_text, tool


@dataclass(kw_only=True)
class ToolRunnerConfig:
    """How tool calls run."""

    tool_timeout_s: float = 30.0
    """Deadline of one call; past it the call's observation is a timeout error."""
    max_concurrent: int = 8
    """Most calls running at once (also the sync tools' thread-pool size)."""

    def __post_init__(self) -> None:
        if not self.tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {self.tool_timeout_s}")
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")


class ToolRunner:
    """Runs tool calls with a deadline and a concurrency bound; owns the sync tools' thread pool.

    Share one runner across the episodes of a process (pass it to each `ToolEnv`) so the bound
    holds for all of them; `close` it when done. A runner serves one event loop.
    """

    def __init__(self, config: ToolRunnerConfig | None = None):
        self.config = config or ToolRunnerConfig()
        self._pool = ThreadPoolExecutor(self.config.max_concurrent, thread_name_prefix="asyncrl-tool")
        self._slots: asyncio.Semaphore | None = None

    async def call(self, t: Tool, arguments: Any) -> str:
        """``t(**arguments)`` as text; `ToolCallError` (the observation's message) on any failure."""
        bound = t.bind(arguments)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.max_concurrent)
        timeout = self.config.tool_timeout_s
        async with self._slots:
            if t.is_async:
                work = t.fn(*bound.args, **bound.kwargs)
            else:
                loop = asyncio.get_running_loop()
                work = loop.run_in_executor(self._pool, functools.partial(t.fn, *bound.args, **bound.kwargs))
            try:
                async with asyncio.timeout(timeout):  # in this task (wait_for would start one per call)
                    value = await work
            except TimeoutError:
                raise ToolCallError(f"tool {t.name!r} timed out after {timeout:g} s (tool_timeout_s)") from None
            except Exception as e:  # noqa: BLE001 - the tool's failure is the model's observation
                raise ToolCallError(f"tool {t.name!r} raised {type(e).__name__}: {e}") from None
        return as_text(t.name, value)

    def close(self) -> None:
        """Stop the pool; queued sync calls are dropped, running ones finish on their own."""
        self._pool.shutdown(wait=False, cancel_futures=True)


class ToolEnv(Env):
    """An `Env` that answers tool calls (see the module docstring).

    ``ToolEnv(tools=[fn, ...])``: functions are made tools with `tool` (so they need type hints
    and a docstring); ``parser`` reads the calls (`HermesParser` by default); ``runner`` runs
    them (a private one with ``tool_timeout_s`` / ``max_concurrent`` when not given);
    ``system`` is an optional system message put before the prompt.
    """

    def __init__(self, tools: Iterable[Any], *, parser: ToolCallParser | None = None,
                 runner: ToolRunner | None = None, tool_timeout_s: float = 30.0, max_concurrent: int = 8,
                 system: str | None = None):
        self._tools: dict[str, Tool] = {}
        for t in map(tool, tools):
            if t.name in self._tools:
                raise ValueError(f"ToolEnv: two tools are named {t.name!r}")
            self._tools[t.name] = t
        self.tools = tuple(t.schema for t in self._tools.values())
        self.parser = parser or HermesParser()
        self._own_runner = runner is None
        self.runner = runner or ToolRunner(ToolRunnerConfig(tool_timeout_s=tool_timeout_s,
                                                            max_concurrent=max_concurrent))
        self.system = system

    def share_runner(self, runner: ToolRunner) -> None:
        """Run calls on ``runner`` (shared by every episode of a process, so its timeout and bound
        hold for all of them) instead of a private one; a runner given at construction is kept."""
        if self._own_runner:
            self.runner.close()
            self.runner, self._own_runner = runner, False

    async def reset(self, prompt: Any) -> list[Message]:
        """``[system?, user]``: the prompt's text (a str, or an object with ``.text``) as the user turn."""
        if isinstance(prompt, list):
            return prompt
        text = prompt if isinstance(prompt, str) else getattr(prompt, "text", None)
        if not isinstance(text, str):
            raise TypeError(f"ToolEnv.reset: prompt must be a str, a list of messages or have .text, "
                            f"got {type(prompt).__name__}")
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, {"role": "user", "content": text}]

    async def step(self, assistant_text: str) -> Step:
        calls = self.parser.parse(assistant_text)
        if not calls:
            return Step(observation=[], done=True)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._run(c)) for c in calls]
        outputs = [t.result() for t in tasks]
        errors = sum(not ok for _, ok in outputs)
        observation = [{"role": "tool", "name": c.name or "", "content": text}
                       for c, (text, _) in zip(calls, outputs)]
        return Step(observation=observation, tool_calls=len(calls), tool_errors=errors)

    async def _run(self, call: ToolCall) -> tuple[str, bool]:
        """(observation text, succeeded)."""
        if call.error is not None:
            return f"Error: {call.error}", False
        t = self._tools.get(call.name)
        if t is None:
            return f"Error: unknown tool {call.name!r}; available: {', '.join(self._tools) or 'none'}", False
        try:
            return await self.runner.call(t, call.arguments), True
        except ToolCallError as e:
            return f"Error: {e}", False

    async def close(self) -> None:
        if self._own_runner:
            self.runner.close()
