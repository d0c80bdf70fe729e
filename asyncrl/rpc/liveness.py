"""How a caller learns that the actor it calls has died: through Ray, which watches the actor.

Each process's link to an actor keeps one Ray call to it open (``rpc_watch``, renewed every
`WATCH_S`). When the actor dies that call fails with Ray's own error
(`ray.exceptions.RayActorError`), and the link fails every call in flight and every later one
with it: callers tell a dead replica exactly as they do through Ray.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

WATCH_S = 60.0
"""How long one ``rpc_watch`` call waits in the actor before the link renews it."""


async def hold(seconds: float) -> None:
    """The actor's side of a watch: one open call, answered after ``seconds``."""
    await asyncio.sleep(seconds)


async def watch(handle: Any, on_dead: Callable[[BaseException], None]) -> None:
    """Keep one ``rpc_watch`` call open to ``handle`` until it fails: then ``on_dead(Ray's error)``."""
    try:
        while True:
            await handle.rpc_watch.remote(WATCH_S)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the actor is gone (Ray's error says how)
        on_dead(exc)
