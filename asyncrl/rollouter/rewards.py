"""`Rewards`: each response's reward, started as the response ends, off the Rollouter's event loop.

A coroutine reward function runs as a task; a plain one on ``workers`` threads. The group reads
the values once its last response ended (`Rewards.value`): by then most are done, so a plain
reward costs the event loop no wake-up of its own, and rewards still run beside generation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from asyncrl.usercode import UserCodeError

Pending = asyncio.Task | concurrent.futures.Future

_OWNER: contextvars.ContextVar[set[Pending] | None] = contextvars.ContextVar("asyncrl_reward_owner", default=None)
"""The rewards started under one `Rewards.owned` call: its tasks (the group's response tasks)
copy this context, so every reward they start lands in the same set."""


class Rewards:
    """``reward_fn(prompt, response_ids) -> float`` (or an awaitable of one), run per response."""

    def __init__(self, reward_fn: Callable[[Any, np.ndarray], float | Awaitable[float]], workers: int):
        self.reward_fn, self.workers = reward_fn, workers
        self._coroutine = inspect.iscoroutinefunction(reward_fn)  # (asked once: `start` runs per response)
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None

    def open(self) -> None:
        """Start the reward threads (a `Rollouter.run` does, and `close`s them when it returns)."""
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="asyncrl-reward")

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None

    def start(self, prompt: Any, response_ids: np.ndarray) -> Pending:
        """Start one response's reward: a coroutine function as a task, a plain one on the threads
        (owned by the `owned` call it runs under, if any: cancelled with that group)."""
        if self._coroutine:
            pending: Pending = asyncio.ensure_future(self.reward_fn(prompt, response_ids))
        elif self._threads is None:
            raise RuntimeError("Rewards.start before open(): the reward threads are not running")
        else:
            pending = self._threads.submit(self.reward_fn, prompt, response_ids)
        owner = _OWNER.get()
        if owner is not None:  # (kept done or not: the set lives as long as its group, n entries)
            owner.add(pending)
        return pending

    @staticmethod
    async def owned(group: Awaitable[Any]) -> Any:
        """Await one group's work (run it as its own task), owning the rewards started under it:
        if it fails or is cancelled, those not done are cancelled with it (none is orphaned)."""
        owner: set[Pending] = set()
        _OWNER.set(owner)  # this task's own context: the group's response tasks copy it
        try:
            return await group
        except BaseException:
            for pending in list(owner):
                pending.cancel()
            raise

    @staticmethod
    def done_value(pending: Pending) -> float | None:
        """The value of a reward `start` started, if it is done and plain (no awaitable returned):
        read now, with no coroutine of its own (most are done by the time their group reads them);
        None otherwise (`value` awaits it). Raises what the reward function raised."""
        if pending.done():
            value = pending.result()
            if not inspect.isawaitable(value):
                return float(value)
        return None

    @staticmethod
    async def value(pending: Pending) -> float:
        """The value of a reward `start` started (awaited only if not done yet)."""
        if isinstance(pending, concurrent.futures.Future):
            value = pending.result() if pending.done() else await asyncio.wrap_future(pending)
        else:
            value = await pending
        return float(await value if inspect.isawaitable(value) else value)


async def score(reward_fn: Callable[[Any, np.ndarray], float | Awaitable[float]], prompt: Any,
                response_ids: np.ndarray) -> float:
    """One reward, awaited now (validation): a coroutine function awaited, a plain one on a thread
    so it never blocks the event loop. Its error is the user's (`UserCodeError`, naming the prompt):
    validation has no group to drop, so it stops the run whatever ``rollout.on_user_error``."""
    try:
        if inspect.iscoroutinefunction(reward_fn):
            return await reward_fn(prompt, response_ids)
        return await asyncio.to_thread(reward_fn, prompt, response_ids)
    except Exception as e:  # noqa: BLE001 - the user's reward function
        where = f"the reward function ({getattr(reward_fn, '__qualname__', 'reward_fn')})"
        raise UserCodeError.of(e, where, None, getattr(prompt, "text", None)) from e
