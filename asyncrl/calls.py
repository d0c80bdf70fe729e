"""Call a method on a Ray actor handle or on an in-process object, the same way.

Most parts of asyncrl talk to their peers through Ray actor handles in a run and through plain
objects in unit tests and benchmarks (an `EngineActor` instance, a `TorchEngine`, an
`AggregatorActor`). These two helpers hide the difference: ``handle.method.remote(...)`` when the
attribute has ``.remote``, else ``obj.method(...)``, awaited when it returns an awaitable.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from typing import Any


def is_remote(target: Any, method: str) -> bool:
    """Whether ``target.method`` is a Ray actor method (it has ``.remote``)."""
    return getattr(getattr(target, method, None), "remote", None) is not None


async def call(target: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """``target.method(*args, **kwargs)`` on a Ray actor handle or an in-process object, awaited
    (a plain value is returned as it is)."""
    fn = getattr(target, method)
    remote = getattr(fn, "remote", None)
    out = remote(*args, **kwargs) if remote is not None else fn(*args, **kwargs)
    return await out if inspect.isawaitable(out) else out


async def call_within(target: Any, method: str, timeout_s: float, *args: Any, **kwargs: Any) -> Any:
    """`call` under a deadline: `TimeoutError` past ``timeout_s``. The call is made, and timed,
    in the awaiting task (no task of its own per call), and only once that task runs: a
    coroutine of this gathered and cancelled before it started leaves no call unawaited."""
    async with asyncio.timeout(timeout_s):
        return await call(target, method, *args, **kwargs)


async def stream(target: Any, method: str, *args: Any) -> AsyncIterator[Any]:
    """The items of an async-generator method, as they come: through Ray a streaming generator
    call (``num_returns="streaming"``, each item awaited as it is reported), in process the
    generator itself."""
    fn = getattr(target, method)
    if getattr(fn, "remote", None) is not None:
        async for ref in fn.options(num_returns="streaming").remote(*args):
            yield await ref
    else:
        async for item in fn(*args):
            yield item


async def maybe_await(value: Any) -> Any:
    """``value``, awaited when it is awaitable (a method that may be sync or async)."""
    return await value if inspect.isawaitable(value) else value
