"""`ToolEnv`: an `Env` whose replies are tool results.

Each model turn is parsed for tool calls (`HermesParser` by default). A turn without a call is
the final answer: the episode ends (``done``; the task's reward function scores it unless a
subclass sets a reward). Otherwise every call runs, off the event loop, and the observation is
one ``role="tool"`` message per call, in order, holding its output or its error:

- async tools run as tasks on the loop, cancelled at their timeout;
- sync tools run in worker processes (``sync_tools="process"``, the default: a pebble
  ``ProcessPool`` of ``sync_tool_workers`` forks of this process); a call past its timeout has its
  worker killed (and replaced), so a tool that never returns ends only its call. The price: the
  function and its arguments are pickled (cloudpickle: closures work, a lock or socket does not),
  and a call runs in another process, so it cannot change this process's state (a global, an
  attribute of the env) and state kept in the worker is not seen by other calls. A tool that
  needs to share state in-process: make it ``async``, or ``sync_tools="thread"`` (a thread pool:
  a call that hangs keeps its thread for good; the pool's size bounds how many can);
- every call runs under ``tool_timeout_s`` and at most ``tool_concurrency`` run at once (the
  settings are `ToolRunnerConfig`'s, `asyncrl.agent.limits`);
- a tool that raises, outlives its timeout or returns something that is not text, an unknown
  tool name, malformed JSON, bad arguments: each gives an error observation for that call and
  the conversation goes on. A sync tool that cannot be sent to a worker (does not pickle) is the
  user's error: the episode ends with it (`asyncrl.usercode`).

An async tool that blocks the loop (e.g. ``time.sleep`` inside ``async def``) cannot be timed
out: write it with ``await``.

A tool with a ``call_key`` parameter gets the call's key there (`asyncrl.agent.tools.CALL_KEY`):
``{episode_id}/t{turn}/{i}``, the i-th call of the episode's turn ``turn``; ``episode_id`` is the
`Env.episode_id` the loop sets (``{sample_id}/{k}`` in a run: the same when the conversation is
generated again after a resume).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncrl.agent.base import Env, Message, Step
from asyncrl.agent.limits import ToolRunnerConfig
from asyncrl.agent.parsers import HermesParser, ToolCall, ToolCallParser
from asyncrl.agent.tools import CALL_KEY, Tool, ToolCallError, as_text, tool


def _run_pickled(blob: bytes) -> Any:
    """In a worker process: the tool call ``blob`` holds (function, args, kwargs), cloudpickled."""
    import cloudpickle

    fn, args, kwargs = cloudpickle.loads(blob)
    return fn(*args, **kwargs)


class ToolRunner:
    """Runs tool calls with a deadline and a concurrency bound; owns the sync tools' workers.

    Share one runner across the episodes of a process (pass it to each `ToolEnv`) so the bound
    holds for all of them; `close` it when done. A runner serves one event loop.
    """

    def __init__(self, config: ToolRunnerConfig | None = None):
        self.config = config or ToolRunnerConfig()
        self._threads: ThreadPoolExecutor | None = None
        self._processes: Any = None  # pebble.ProcessPool, started at the first sync call
        self._slots: asyncio.Semaphore | None = None
        self._worker_slots: asyncio.Semaphore | None = None
        self.killed = 0
        """Sync calls whose worker process was killed at their timeout."""

    async def call(self, t: Tool, arguments: Any, call_key: str | None = None) -> str:
        """``t(**arguments)`` as text; `ToolCallError` (the observation's message) on any failure."""
        bound = t.bind(arguments)
        if t.wants_call_key:
            bound.arguments[CALL_KEY] = call_key
        kwargs = bound.kwargs
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.tool_concurrency)
            self._worker_slots = asyncio.Semaphore(self.config.sync_tool_workers)
        timeout = self.config.tool_timeout_s
        async with self._slots:
            try:
                if t.is_async:
                    async with asyncio.timeout(timeout):  # in this task (wait_for would start one per call)
                        value = await t.fn(*bound.args, **kwargs)
                elif self.config.sync_tools == "thread":
                    work = asyncio.get_running_loop().run_in_executor(
                        self._thread_pool(), functools.partial(t.fn, *bound.args, **kwargs))
                    async with asyncio.timeout(timeout):
                        value = await work
                else:
                    async with self._worker_slots:  # the deadline counts the call's run, not its wait for a worker
                        value = await self._in_process(t, bound.args, kwargs, timeout)
            except TimeoutError:
                raise ToolCallError(f"tool {t.name!r} timed out after {timeout:g} s (tool_timeout_s)") from None
            except UnpicklableToolError:
                raise
            except Exception as e:  # noqa: BLE001 - the tool's failure is the model's observation
                raise ToolCallError(f"tool {t.name!r} raised {type(e).__name__}: {e}") from None
        return as_text(t.name, value)

    async def _in_process(self, t: Tool, args: tuple, kwargs: dict, timeout: float) -> Any:
        """One sync call in a worker process; at ``timeout`` the worker is killed (pebble)."""
        import cloudpickle

        try:
            blob = cloudpickle.dumps((t.fn, args, kwargs))
        except Exception as e:  # noqa: BLE001 - reported as the user's error, naming the way out
            raise UnpicklableToolError(f"sync tool {t.name!r} cannot run in a worker process: it does not pickle "
                               f"({type(e).__name__}: {e}); make it async, or use sync_tools='thread' "
                               "(rollout.agent.sync_tools)") from None
        future = self._process_pool().schedule(_run_pickled, (blob,), timeout=timeout)
        try:
            # pebble's own timeout kills the worker; this one is a backstop should it be late.
            async with asyncio.timeout(timeout + 5.0):
                return await asyncio.wrap_future(future)
        except TimeoutError:
            self.killed += 1
            raise
        finally:
            future.cancel()  # a call cancelled (or past the backstop): pebble kills its worker

    def _thread_pool(self) -> ThreadPoolExecutor:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self.config.tool_concurrency, thread_name_prefix="asyncrl-tool")
        return self._threads

    def _process_pool(self) -> Any:
        if self._processes is None:
            from pebble import ProcessPool

            # fork: a worker starts in milliseconds (a killed one is replaced at once) and needs
            # nothing of this process's __main__; it only unpickles and runs the call.
            self._processes = ProcessPool(max_workers=self.config.sync_tool_workers,
                                          context=multiprocessing.get_context("fork"))
        return self._processes

    def close(self) -> None:
        """Stop the workers: threads' queued calls are dropped (running ones finish on their own);
        worker processes are stopped, a hung one killed, so the process can exit."""
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            self._processes.stop()
            self._processes.join(timeout=5)
            self._processes = None


class UnpicklableToolError(TypeError):
    """A sync tool that cannot be sent to a worker process: the user's error, not an observation."""


class ToolEnv(Env):
    """An `Env` that answers tool calls (see the module docstring).

    ``ToolEnv(tools=[fn, ...])``: functions are made tools with `tool` (so they need type hints
    and a docstring); ``parser`` reads the calls (`HermesParser` by default); ``runner`` runs
    them (a private one built from ``settings``, the `ToolRunnerConfig` fields ``tool_timeout_s``,
    ``tool_concurrency``, ``sync_tools``, ``sync_tool_workers``, when not given);
    ``system`` is an optional system message put before the prompt.
    """

    def __init__(self, tools: Iterable[Any], *, parser: ToolCallParser | None = None,
                 runner: ToolRunner | None = None, system: str | None = None, **settings: Any):
        if runner is not None and settings:
            raise TypeError(f"ToolEnv: runner given and so are {', '.join(sorted(settings))}: a given runner's "
                            "ToolRunnerConfig holds its settings; give one or the other")
        self._tools: dict[str, Tool] = {}
        for t in map(tool, tools):
            if t.name in self._tools:
                raise ValueError(f"ToolEnv: two tools are named {t.name!r}")
            self._tools[t.name] = t
        self.tools = tuple(t.schema for t in self._tools.values())
        self.parser = parser or HermesParser()
        self._own_runner = runner is None
        self.runner = runner or ToolRunner(ToolRunnerConfig.of(settings, "ToolEnv"))
        self.system = system
        self._turn = 0
        """Turns `step` answered: the turn part of each call's key."""

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
        turn, self._turn = self._turn, self._turn + 1
        if not calls:
            return Step(observation=[], done=True)
        if self.episode_id is None:  # a loop that set none (outside a run): unique, not stable
            self.episode_id = uuid.uuid4().hex
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._run(c, f"{self.episode_id}/t{turn}/{i}")) for i, c in enumerate(calls)]
        except* UnpicklableToolError as eg:  # the user's error, raised as itself (not a group of one)
            raise eg.exceptions[0] from None
        outputs = [t.result() for t in tasks]
        errors = sum(not ok for _, ok in outputs)
        observation = [{"role": "tool", "name": c.name or "", "content": text}
                       for c, (text, _) in zip(calls, outputs)]
        return Step(observation=observation, tool_calls=len(calls), tool_errors=errors)

    async def _run(self, call: ToolCall, key: str) -> tuple[str, bool]:
        """(observation text, succeeded)."""
        if call.error is not None:
            return f"Error: {call.error}", False
        t = self._tools.get(call.name)
        if t is None:
            return f"Error: unknown tool {call.name!r}; available: {', '.join(self._tools) or 'none'}", False
        try:
            return await self.runner.call(t, call.arguments, key), True
        except ToolCallError as e:
            return f"Error: {e}", False

    async def close(self) -> None:
        if self._own_runner:
            self.runner.close()
