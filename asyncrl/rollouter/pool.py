"""The Rollouter's engine replicas: which one serves a group, the calls, their deadlines, dead replicas.

Dispatch is by group. A group's requests of a round go to ONE replica in ONE call
(`EngineActor.generate_group`: several requests in, each one's result or error out, in batches
as they end), so the replica prefills the group's prompt once (the built-in engine shares it,
vLLM's prefix cache hits) and a response costs the Rollouter a fraction of a Ray call. The group
then sticks to that replica: a truncated response resumes there (where its blocks were), and so
does the rest of the group while the replica lives.

- Replica choice: the group's own replica while it is live, else the live replica with the
  fewest requests in flight (lowest index first). `spread` reports how evenly the requests went.
- Deadline: ``timeout_s`` per call, counting only time outside weight-sync pauses
  (`on_pause` / `on_resume`); past it every request of the call still running is aborted on its
  replica and fails with `TimeoutError`.
- A replica whose actor died (or whose engine process did, `EngineClosedError`) gets no further
  requests: the call's unfinished requests go again, whole and with the same seeds, in one call to
  another live replica. Only when none is left do they fail (`EngineDied`).
- In-process engines without a group method (tests hand `TorchEngine` / `SimEngine` objects in)
  get one ``generate`` per request, concurrently.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from asyncrl import calls, rpc
from asyncrl.rpc import Links
from asyncrl.types import GenerateRequest, GenerateResult

log = logging.getLogger("asyncrl.rollouter")

Outcome = GenerateResult | BaseException
Deliver = Callable[[int, Outcome, int], None]
"""``deliver(i, outcome, replica)``: request ``i`` of a call ended with ``outcome`` on ``replica``."""


class EngineDied(RuntimeError):
    """Every engine replica's actor is gone."""


def actor_died(exc: BaseException) -> bool:
    """The replica is gone: its Ray actor died, or the engine inside it did (a vLLM EngineCore
    killed under a live actor raises `EngineClosedError`; through Ray the error keeps its class)."""
    from asyncrl.rollouter.engines.base import EngineClosedError

    if isinstance(exc, EngineClosedError):
        return True
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(exc, RayActorError)


class EnginePool:
    """The engine replicas of one Rollouter (see the module docstring).

    ``engines`` are EngineActor handles or in-process engines; ``batch_s`` is how long a replica
    may hold a finished response to send it with others of the same call (`EngineActor.generate_group`;
    None: the whole call's results in one plain call, `EngineActor.generate_all`).
    """

    def __init__(self, engines: Sequence[Any], timeout_s: float, batch_s: float | None = 0.0, rpc: bool = True):
        if not engines:
            raise ValueError("Rollouter needs at least one engine")
        self.engines = list(engines)
        self._rpc = rpc
        self._linked: dict[int, Any] = {}
        """Replica -> its calls over ZeroMQ (`asyncrl.rpc.link`), made at its first call."""
        self._links = Links()
        """The sockets of those calls (this process's: one `EnginePool` per Rollouter)."""
        self.timeout_s, self.batch_s = timeout_s, batch_s
        self.load = [0] * len(self.engines)
        """Requests in flight per replica."""
        self.sent = [0] * len(self.engines)
        """Requests sent per replica, so far."""
        self.calls = 0
        self.timed_out = 0
        self.dead_engines = 0
        self._live = list(range(len(self.engines)))
        """Replicas not known dead, in index order."""
        self._in_flight: dict[str, int] = {}  # request_id -> replica
        self._paused_at: float | None = None
        self._paused_total = 0.0
        self._busy = 0
        self._idle_since: float | None = time.monotonic()
        self._idle_s = 0.0

    # ------------------------------------------------------------------ choice

    def pick(self, preferred: int | None = None) -> int:
        """``preferred`` while it is live, else the live replica with the fewest requests in flight."""
        if preferred is not None and preferred in self._live:
            return preferred
        if not self._live:
            raise EngineDied("every engine replica is dead")
        return min(self._live, key=self.load.__getitem__)

    def spread(self) -> float:
        """``(max - min) / mean`` of the requests sent to each live replica (0: perfectly even)."""
        counts = [self.sent[e] for e in self._live]
        mean = sum(counts) / len(counts) if counts else 0.0
        return (max(counts) - min(counts)) / mean if mean else 0.0

    async def replace_engine(self, index: int, engine: Any) -> None:
        """Replica ``index`` was started again (it holds the current weights): requests go to it again."""
        self.engines[index] = engine  # (its load counts requests in flight: those to the dead one end on their own)
        self._linked.pop(index, None)
        if index not in self._live:
            self._live = sorted([*self._live, index])

    # ------------------------------------------------------------------ calls

    async def call(self, e: int, requests: dict[int, GenerateRequest], truncatable: bool, deliver: Deliver) -> None:
        """Run ``requests`` (key -> request) in one call on replica ``e``; ``deliver`` each outcome.

        Every key is delivered, or the call raises: an actor-died error (the caller re-sends
        what is left on another replica; `mark_dead` first) or any other error of the call.
        Past the deadline the call's running requests are aborted and delivered `TimeoutError`.
        """
        keys = list(requests)
        left = set(keys)
        self._enter(e, [requests[k].request_id for k in keys])

        def done(k: int, outcome: Outcome) -> None:
            left.discard(k)
            self._exit(e, [requests[k].request_id])  # a finished request no longer loads its replica
            deliver(k, outcome, e)

        async def consume() -> None:
            engine = self._linked.get(e) or await self.engine(e)
            async for batch in self._stream(engine, [requests[k] for k in keys], truncatable):
                for j, outcome in batch:
                    if isinstance(outcome, BaseException) and actor_died(outcome):
                        raise outcome  # the replica is gone: what is left goes elsewhere
                    if keys[j] in left:
                        done(keys[j], outcome)

        deadline = _Deadline(self, asyncio.current_task())
        try:
            await consume()
            if deadline.expired:  # its cancel came too late to stop the call: not a timeout
                deadline.task.uncancel()
        except asyncio.CancelledError:
            if not deadline.expired or deadline.task.uncancel() > 0:  # a cancel from outside, not the deadline
                raise
            running = [k for k in keys if k in left]
            error = TimeoutError(f"no result within request_timeout_s={self.timeout_s} (time paused for "
                                 f"weight syncs not counted); aborted on engine replica {e} with the rest "
                                 "of its call")
            for k in running:  # failed first: what the abort hands back is not delivered
                done(k, error)
            await self._time_out(e, [requests[k].request_id for k in running])
        finally:
            deadline.cancel()
            self._exit(e, [requests[k].request_id for k in left], call_ended=True)

    async def engine(self, e: int) -> Any:
        """Replica ``e`` to call: its `asyncrl.rpc` link where it serves one (asked once), else its handle."""
        linked = self._linked.get(e)
        if linked is None:
            engine = self.engines[e]
            linked = await rpc.link(engine, self._links) if self._rpc else engine
            if self.engines[e] is engine:  # not replaced meanwhile
                self._linked[e] = linked
        return linked

    def handle(self, e: int) -> Any:
        """Replica ``e`` as it is called now: its link once made, else its handle."""
        return self._linked.get(e, self.engines[e])

    async def _time_out(self, e: int, running: list[str]) -> None:
        self.timed_out += len(running)
        try:
            await calls.call_within(self.handle(e), "abort", 30.0, running)
        except Exception:  # noqa: BLE001 - the engine may be gone; the timeout is the error that matters
            pass

    def _stream(self, engine: Any, requests: list[GenerateRequest], truncatable: bool) -> AsyncIterator[list]:
        if not hasattr(engine, "generate_group"):
            return _each(engine, requests, truncatable)
        if self.batch_s is None:
            return _at_once(engine, requests, truncatable)
        return calls.stream(engine, "generate_group", requests, truncatable, self.batch_s)

    def mark_dead(self, e: int, exc: BaseException) -> None:
        """Replica ``e``'s actor died: no further requests go to it."""
        if e in self._live:
            self._live.remove(e)
            self.dead_engines += 1
            log.error("engine replica %d died (%r); no further requests go to it", e, exc)

    async def abort_all(self, timeout_s: float = 30.0) -> None:
        """Abort every request in flight on its replica (a stopping Rollouter's drain)."""
        by_engine: dict[int, list[str]] = {}
        for request_id, e in self._in_flight.items():
            by_engine.setdefault(e, []).append(request_id)
        aborts = [calls.call(self.handle(e), "abort", ids) for e, ids in by_engine.items()]
        results = await asyncio.wait_for(asyncio.gather(*aborts, return_exceptions=True), timeout_s)
        for e, result in zip(by_engine, results):
            if isinstance(result, BaseException):
                log.warning("engine %d did not abort its requests at stop: %s", e, result)

    def close(self) -> None:
        """Close this pool's sockets to the replicas (`Links.close`): at the Rollouter's stop, after its aborts."""
        self._links.close()

    # ------------------------------------------------------------------ clocks and counters

    def on_pause(self) -> None:
        """A weight sync pauses the engines: deadlines stand still until `on_resume`."""
        if self._paused_at is None:
            self._paused_at = time.monotonic()

    def on_resume(self) -> None:
        if self._paused_at is not None:
            self._paused_total += time.monotonic() - self._paused_at
            self._paused_at = None

    def active_time(self) -> float:
        """Monotonic time that stands still while the engines are paused for a weight sync."""
        now = time.monotonic()
        return now - self._paused_total - (now - self._paused_at if self._paused_at is not None else 0.0)

    def idle_s(self) -> float:
        """Time so far with no call in flight on any replica."""
        if self._busy == 0 and self._idle_since is not None:
            return self._idle_s + time.monotonic() - self._idle_since
        return self._idle_s

    def _enter(self, e: int, ids: list[str]) -> None:
        if self._busy == 0 and self._idle_since is not None:
            self._idle_s += time.monotonic() - self._idle_since
            self._idle_since = None
        self._busy += 1
        self.calls += 1
        self.load[e] += len(ids)
        self.sent[e] += len(ids)
        for rid in ids:
            self._in_flight[rid] = e

    def _exit(self, e: int, ids: list[str], call_ended: bool = False) -> None:
        if call_ended:
            self._busy -= 1
            if self._busy == 0:
                self._idle_since = time.monotonic()
        self.load[e] -= len(ids)
        for rid in ids:
            self._in_flight.pop(rid, None)


class _Deadline:
    """A call's deadline: past ``pool.timeout_s`` of the pool's active time it cancels ``task``
    (``expired`` tells that cancel from others); re-armed while a weight-sync pause stops that
    clock. A timer handle, not a task or a wait per call; `cancel` leaves no reference cycle."""

    __slots__ = ("pool", "task", "start", "expired", "_handle")

    def __init__(self, pool: EnginePool, task: asyncio.Task):
        self.pool, self.task, self.expired = pool, task, False
        self.start = pool.active_time()
        self._handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(pool.timeout_s, self._check)

    def _check(self) -> None:
        remaining = self.pool.timeout_s - (self.pool.active_time() - self.start)
        if remaining > 0:
            self._handle = asyncio.get_running_loop().call_later(remaining, self._check)
        else:
            self.expired = True
            self.task.cancel()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


async def _at_once(engine: Any, requests: list[GenerateRequest], truncatable: bool) -> AsyncIterator[list]:
    """Every outcome of the call in one batch, from one plain call (`EngineActor.generate_all`)."""
    yield await calls.call(engine, "generate_all", requests, truncatable)


async def _each(engine: Any, requests: list[GenerateRequest], truncatable: bool) -> AsyncIterator[list]:
    """An engine with no group method: one ``generate`` per request, concurrently, each outcome
    as it ends (the shape of `EngineActor.generate_group`'s batches)."""

    async def one(j: int, request: GenerateRequest) -> tuple[int, Outcome]:
        try:
            return j, await calls.call(engine, "generate", *((request, True) if truncatable else (request,)))
        except Exception as exc:  # noqa: BLE001 - handed back as this request's outcome
            return j, exc

    tasks = [asyncio.ensure_future(one(j, r)) for j, r in enumerate(requests)]
    try:
        for next_done in asyncio.as_completed(tasks):
            yield [await next_done]
    finally:
        for t in tasks:
            t.cancel()


class Placed(Protocol):
    """The record of a response or conversation (`asyncrl.rollouter.response`): where its request went."""

    replica: int


class GroupCalls:
    """One group's way to its replica: the requests it asks for in the same turn of the event
    loop (a group's start, a round's resumed responses) go out in one call; the group keeps the
    replica it got (`EnginePool.pick`), and moves only when that one dies. Each request's record
    (`Placed`) notes the replica as the request goes out: a conversation aborts a turn it gives up
    and ends its sessions there."""

    def __init__(self, pool: EnginePool):
        self.pool = pool
        self.replica: int | None = None
        """The group's replica (None: no call yet); its responses' own are in their records."""
        self._pending: list[tuple[GenerateRequest, bool, asyncio.Future, Placed | None]] = []
        self._tasks: set[asyncio.Task] = set()

    async def generate(self, request: GenerateRequest, truncatable: bool,
                       record: Placed | None = None) -> tuple[GenerateResult, int]:
        """``request``'s result and the replica that produced it; ``record.replica`` is set as it goes out."""
        future = asyncio.get_running_loop().create_future()
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append((request, truncatable, future, record))
        return await future

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for truncatable in (False, True):
            items = [(r, f, p) for r, t, f, p in pending if t == truncatable and not f.done()]
            if items:
                task = asyncio.ensure_future(self._run(items, truncatable))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _run(self, items: list[tuple[GenerateRequest, asyncio.Future, Placed | None]], truncatable: bool) -> None:
        """One call of ``items`` (request, its future, its record), again on another replica for what a dead one left."""
        left = {i: request for i, (request, _, _) in enumerate(items)}

        def deliver(i: int, outcome: Outcome, replica: int) -> None:
            left.pop(i, None)
            future = items[i][1]
            if not future.done():
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result((outcome, replica))

        try:
            while left:
                e = self.replica = self.pool.pick(self.replica)
                for i in left:  # where each request is now: a conversation aborts a turn or ends its sessions there
                    record = items[i][2]
                    if record is not None:
                        record.replica = e
                try:
                    await self.pool.call(e, dict(left), truncatable, deliver)
                except Exception as exc:
                    if not actor_died(exc):
                        raise
                    self.pool.mark_dead(e, exc)  # the rest of the call goes whole to another replica
        except Exception as exc:  # no live replica, or the call failed: every unfinished request fails
            for i in list(left):
                deliver(i, exc, self.replica if self.replica is not None else -1)

    async def close(self) -> None:
        """Cancel the group's calls still running (its responses were cancelled: `Rollouter.stop`)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
