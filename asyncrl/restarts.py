"""Engine replicas started again, the weight sync that tells the Rollouter, and its feed state for checkpoints.

`EngineRestarter` owns its restarts: each is a task it tracks; `EngineRestarter.close` cancels
those still under way, kills the actors they started, and reports every one (a restart in
progress at shutdown is named, a failed one says why), so none outlives the run unseen.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("asyncrl.launch")


class EngineRestarter:
    """Starts a dead engine replica again in its own placement bundle (``max_restarts`` times each,
    ``backoff_s`` x k before restart k); `NotifyingSyncer` adds it back at the next sync.

    A start that fails (the new actor dies, or ``start_engine`` raises) uses up a restart like a
    death does: the replica, still dead to the coordinator, is started again at the next
    `notice`, and past ``max_restarts`` it is left out with a line naming it and why."""

    def __init__(self, start_engine: Callable[[int], Any], max_restarts: int, backoff_s: float):
        self.start_engine, self.max_restarts, self.backoff_s = start_engine, max_restarts, backoff_s
        self.restarts: dict[int, int] = {}
        self.starting: dict[int, asyncio.Task] = {}
        self.died_at: dict[int, float] = {}
        self.left_out: set[int] = set()
        self.start_errors: dict[int, BaseException] = {}
        """Replica -> why its last start failed (cleared when a start succeeds)."""
        self._started: dict[int, Any] = {}  # actors started, not yet handed out by `ready`: `close` kills them
        self._closed = False

    def notice(self, dead: dict[str, str]) -> None:
        """Start again every replica in ``dead`` (the coordinator's) not yet being started."""
        from asyncrl.sync.coordinator import engine_index

        if self._closed:  # (a sync racing the close starts nothing more)
            return
        for name, why in dead.items():
            i = engine_index(name)
            if i is None or i in self.starting or i in self.left_out:
                continue
            failed_start = self.start_errors.get(i)
            what = f"did not start again ({failed_start!r})" if failed_start is not None else f"died ({why})"
            k = self.restarts.get(i, 0) + 1
            if k > self.max_restarts:
                self.left_out.add(i)
                print(f"asyncrl: {name} {what}; left out: engine.max_restarts={self.max_restarts} used",
                      flush=True)
                continue
            self.restarts[i] = k
            if failed_start is None:  # (a retry keeps the time it was first found dead)
                self.died_at[i] = time.monotonic()
            print(f"asyncrl: {name} {what}; starting it again ({k}/{self.max_restarts}) in "
                  f"{self.backoff_s * k:g} s", flush=True)
            self.starting[i] = asyncio.ensure_future(self._start(i, self.backoff_s * k))

    async def _start(self, i: int, wait: float) -> Any:
        await asyncio.sleep(wait)
        handle = self._started[i] = self.start_engine(i)
        await handle.ready.remote()
        return handle

    def ready(self) -> dict[int, Any]:
        """Replicas started and ready since the last call (a failed start is noticed again later)."""
        out = {}
        for i, task in list(self.starting.items()):
            if not task.done():
                continue
            del self.starting[i]
            self._started.pop(i, None)  # handed out (or failed): its owner is the caller now
            if task.exception() is not None:
                self.start_errors[i] = task.exception()
                log.warning("engine[%d] did not start again: %r", i, task.exception())
                print(f"asyncrl: engine[{i}] did not start again ({task.exception()!r})", flush=True)
                continue
            self.start_errors.pop(i, None)
            out[i] = task.result()
        return out

    async def close(self, kill: Callable[[Any], None] | None = None) -> None:
        """Stop every restart: one under way is cancelled and awaited, the actor it started (ready
        or not, not handed out by `ready`) given to ``kill``; each is reported with a line naming
        the replica: cancelled at shutdown, or why its start failed."""
        self._closed = True
        for task in self.starting.values():
            task.cancel()
        outcomes = await asyncio.gather(*self.starting.values(), return_exceptions=True)
        for (i, task), outcome in zip(list(self.starting.items()), outcomes):
            if isinstance(outcome, asyncio.CancelledError):
                why = "its restart was under way at shutdown: cancelled"
            elif isinstance(outcome, BaseException):
                why = f"did not start again ({outcome!r})"
                self.start_errors[i] = outcome
            else:
                why = "started again after the last weight sync: it served no request"
            log.warning("engine[%d] %s", i, why)
            print(f"asyncrl: engine[{i}] {why}", flush=True)
        self.starting.clear()
        started, self._started = self._started, {}
        for i, handle in started.items():
            if kill is not None:
                try:
                    kill(handle)
                except Exception as e:  # noqa: BLE001 - an actor already gone; the others still go
                    log.warning("engine[%d]'s new actor could not be killed: %r", i, e)


class NotifyingSyncer:
    """Tell the Rollouter a sync pauses the engines, run the coordinator's sync, then tell it
    which version the engines now serve.

    An engine that died is dropped by the coordinator; while live engines took the new weights
    the run goes on with them (the Rollouter stops using a dead engine on its own). With a
    `EngineRestarter`, a dead replica is started again and, once ready, joins the next sync: it
    gets that sync's weights before the Rollouter sends it a request."""

    def __init__(self, coordinator: Any, rollouter: Any, restarter: EngineRestarter | None = None,
                 on_engine: Callable[[int, Any], None] | None = None):
        self.coordinator, self.rollouter, self.restarter, self.on_engine = coordinator, rollouter, restarter, on_engine

    async def sync(self) -> int:
        from asyncrl.sync import WeightSyncError
        from asyncrl.sync.coordinator import engine_name

        c = self.coordinator
        joining = self.restarter.ready() if self.restarter else {}
        for i, handle in joining.items():
            c.add_engine(engine_name(i), handle)
        await self.rollouter.on_pause.remote()
        try:
            version = await c.sync()
        except WeightSyncError as e:
            if not c.engines or not set(c.last.failed) <= set(c.dead) or c.version != c.last.version:
                raise
            log.warning("weight sync to version %d went on without dead engines: %s", c.version, e)
            print(f"asyncrl: engine(s) {', '.join(c.last.failed)} died; going on with {len(c.engines)}", flush=True)
            version = c.version
        for i, handle in joining.items():
            if engine_name(i) in c.engines:  # it took this sync's weights: it serves from now on
                if self.on_engine is not None:
                    self.on_engine(i, handle)
                await self.rollouter.replace_engine.remote(i, handle)
                print(f"asyncrl: engine[{i}] serves again at version {version}, "
                      f"{time.monotonic() - self.restarter.died_at[i]:.1f} s after it was found dead", flush=True)
        await self.rollouter.on_sync.remote(version)
        if self.restarter is not None:
            self.restarter.notice(c.dead)
        return version


class FeedState:
    """The Rollouter's feed state for each checkpoint; if the Rollouter cannot answer (it died),
    the last answer it gave, marked stale (`RolloutState.resume` moves a stale position past the
    committed ids)."""

    def __init__(self, rollouter: Any, last: dict | None = None, timeout_s: float = 60.0):
        self.rollouter, self.last, self.timeout_s = rollouter, dict(last or {}), timeout_s

    async def __call__(self) -> dict:
        try:
            self.last = await asyncio.wait_for(self.rollouter.feed_state.remote(), self.timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure to answer leaves the last known state
            log.warning("the Rollouter did not give its feed state (%s: %s); the checkpoint keeps its last one",
                        type(e).__name__, e)
            return {**self.last, "stale": True}
        return self.last
