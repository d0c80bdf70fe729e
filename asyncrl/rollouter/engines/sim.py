"""A simulated engine: the `RolloutEngine` semantics with no model, for driving the control plane
at cluster size (many replicas in one process) in tests and benchmarks.

What is real: requests, continuous batching over ``max_running`` slots, the pause modes
(``abort`` ends in-flight requests with their partial output, ``wait`` drains, ``keep`` freezes
them and ``clear_cache`` counts their re-prefill), ``abort`` with partial output, ``progress``,
weight loads only while paused, and the weight version of every token. What is simulated: the
tokens (a window of the engine's seeded token and log-prob tables, picked with the length by one
hash of the request's seed: O(1), no generator per request) and the time they take. Each request's
length is drawn from the long-tail distribution of the built-in task's benchmark workload
(`asyncrl.tasks.arithmetic.long_tail_budget`: 0.7 at the median, the rest at 2x..``long_tail``x),
capped at its ``max_tokens`` (then ``finish_reason="length"``, else ``"stop"``).

Time: the engine decodes in steps of ``max_running / tokens_per_s`` seconds, one token for each
running request per step, as a batching engine does; a full engine makes ``tokens_per_s`` tokens
a second. Nothing is done per token: the engine keeps a step clock (frozen while paused with
``keep`` or ``abort``), each running request knows the step it started at, and one scheduler task
per engine wakes only when the next request is due. So a replica costs a task and a heap, and a
hundred of them fit in one event loop beside the Rollouter. With ``prefill_tokens_per_s`` set, a
request's first token also waits for its prefill; a turn of a conversation (``session_id``) that
extends its session's last turn prefills only its new tokens (`SimSessions`, until `end_session`).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import heapq
import time
import zlib
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncrl.rollouter.engines.base import (PAUSE_MODES, EngineClosedError, EngineError, EnginePausedError, PauseMode,
                                           mix64)
from asyncrl.rollouter.engines.sim_sessions import SimSessions
from asyncrl.tasks.arithmetic import long_tail_probs
from asyncrl.types import GenerateRequest, GenerateResult


@dataclass(kw_only=True)
class SimEngineConfig:
    """Settings of one simulated replica."""

    tokens_per_s: float = 2000.0
    """Tokens a second with every slot busy (each running request gets ``tokens_per_s / max_running``)."""
    max_running: int = 32
    """Requests decoded at once; more wait in a queue for a slot."""
    median_tokens: int = 6
    """Median response length, in tokens."""
    long_tail: int = 16
    """Longest response as a multiple of the median (1 or a power of 2; 1: every response is the median)."""
    vocab_size: int = 64
    """Token ids are drawn from ``3 .. vocab_size - 1``; ``eos_token_id`` ends a response that stops."""
    eos_token_id: int = 2
    seed: int = 0
    """Mixed into every request's own seed (its ``sampling.seed``, else its id)."""
    pause_timeout_s: float = 600.0
    """How long ``pause("wait")`` waits for in-flight requests to drain."""
    prefill_tokens_per_s: float | None = None
    """Prompt tokens a second one request's prefill takes before its first token (in its slot, not
    slowing the others). None: prefill takes no time (the single-turn benchmarks' model)."""

    def __post_init__(self) -> None:
        if self.tokens_per_s <= 0:
            raise ValueError(f"SimEngineConfig.tokens_per_s must be > 0, got {self.tokens_per_s}")
        for name in ("max_running", "median_tokens", "long_tail"):
            if getattr(self, name) < 1:
                raise ValueError(f"SimEngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.long_tail & (self.long_tail - 1):
            raise ValueError(f"SimEngineConfig.long_tail must be 1 or a power of 2, got {self.long_tail}")
        if self.prefill_tokens_per_s is not None and self.prefill_tokens_per_s <= 0:
            raise ValueError(f"SimEngineConfig.prefill_tokens_per_s must be > 0 or None, got {self.prefill_tokens_per_s}")
        if self.vocab_size <= 3 or not 0 <= self.eos_token_id < 3:
            raise ValueError("SimEngineConfig.vocab_size must be > 3 and eos_token_id in 0..2")

    @property
    def step_s(self) -> float:
        return self.max_running / self.tokens_per_s


@dataclass(eq=False)
class _Request:
    request: GenerateRequest
    future: asyncio.Future
    ids: np.ndarray
    """The whole response it will produce (its drawn length)."""
    logprobs: np.ndarray
    stops: bool
    start: float = 0.0
    """Engine step its first token's decode began at (its slot, plus its prefill)."""

    @property
    def rid(self) -> str:
        return self.request.request_id

    def generated(self, step: float) -> int:
        return max(0, min(len(self.ids), int(step - self.start + 1e-9)))


@dataclass
class _Clock:
    """Engine steps: advance with wall time while running, stand still while frozen."""

    step_s: float
    steps: float = 0.0
    since: float | None = field(default_factory=time.monotonic)
    """Wall time the clock last started; None while frozen."""

    def now(self) -> float:
        return self.steps if self.since is None else self.steps + (time.monotonic() - self.since) / self.step_s

    def freeze(self) -> None:
        self.steps, self.since = self.now(), None

    def run(self) -> None:
        if self.since is None:
            self.since = time.monotonic()

    def seconds_until(self, step: float) -> float | None:
        return None if self.since is None else max(0.0, (step - self.now()) * self.step_s)


class SimEngine:
    """A simulated replica (see the module docstring)."""

    def __init__(self, config: SimEngineConfig | None = None, **kwargs):
        if config is not None and kwargs:
            raise ValueError("pass either config= or keyword settings, not both")
        self.config = config or SimEngineConfig(**kwargs)
        self._clock = _Clock(self.config.step_s)
        self._version = 0
        self._marks: list[tuple[float, int]] = [(0.0, 0)]
        """(engine step, version live from that step on): the version of every token."""
        self._queued: deque[_Request] = deque()
        self._running: dict[str, _Request] = {}
        self._in_flight: set[str] = set()
        """Ids queued or running (a request id may be reused once its request has ended)."""
        self._due: list[tuple[float, int, _Request]] = []
        """Heap of (step the request ends at, tie-break, request); entries of finished ones are skipped."""
        self._paused: PauseMode | None = None
        self._closed = False
        self._counters = dict(requests=0, tokens_generated=0, reprefill_tokens=0, prefill_tokens=0, weight_loads=0)
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        """Set when the scheduler must look again (a request, a resume, an abort)."""
        self._finished = asyncio.Event()
        """Set whenever a request ends (``pause("wait")`` watches it)."""
        self._tie = 0
        self._sessions = SimSessions()
        # What `_draw` takes responses from: the length distribution's CDF over k (a response of
        # ``median * 2**k`` tokens) and token / log-prob tables long enough for the longest one.
        self._length_cdf = np.cumsum(long_tail_probs(self.config.long_tail))[:-1].tolist()
        longest = self.config.median_tokens * self.config.long_tail
        rng = np.random.default_rng(self.config.seed)
        self._ids_table = rng.integers(3, self.config.vocab_size, size=longest + _TABLE_OFFSETS, dtype=np.int64)
        self._logprob_table = -rng.exponential(1.0, size=longest + _TABLE_OFFSETS).astype(np.float32)

    # ---------------------------------------------------------------- lifecycle

    # Every change of state happens between two awaits of one event loop, so nothing here takes a
    # lock; the scheduler is woken through `_wake` and sleeps until the next request is due.

    def _start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._schedule(), name="sim-engine-scheduler")
        self._wake.set()

    async def close(self) -> None:
        """Stop the scheduler; requests still in flight end with `EngineClosedError`."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        error = EngineClosedError("the engine was closed")
        for r in [*self._queued, *self._running.values()]:
            if not r.future.done():
                r.future.set_exception(error)
        self._queued.clear()
        self._running.clear()
        self._in_flight.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine was closed")

    # ---------------------------------------------------------------- requests

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Generate one response; waits while the engine is paused with ``keep``."""
        self._check_open()
        if self._paused in ("abort", "wait"):
            raise EnginePausedError(f"request {request.request_id} refused: the engine is paused with "
                                    f"mode={self._paused!r}; call resume() first")
        if request.request_id in self._in_flight:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        r = self._draw(request)
        r.future.add_done_callback(lambda f: f.cancelled() and self._wake.set())  # a cancelled caller frees its slot
        self._queued.append(r)
        self._in_flight.add(r.rid)
        self._counters["requests"] += 1
        self._start()
        # Cancelling the caller cancels the future; the scheduler then drops the request.
        return await r.future

    def _draw(self, request: GenerateRequest) -> _Request:
        # O(1) per request, no generator to seed: one 64-bit mix of (engine seed, request seed)
        # picks the length from the long-tail distribution and a window of the engine's token table.
        cfg = self.config
        own = request.sampling.seed if request.sampling.seed is not None else _stable_hash(request.request_id)
        h = mix64(cfg.seed * 0x9E3779B97F4A7C15 + own)
        drawn = cfg.median_tokens << bisect.bisect_right(self._length_cdf, (h >> 11) * 2.0**-53)
        n = min(drawn, request.max_tokens)
        start = mix64(h) % _TABLE_OFFSETS
        ids = self._ids_table[start:start + n].copy()
        stops = drawn < request.max_tokens
        if stops:
            ids[-1] = cfg.eos_token_id
        logprobs = self._logprob_table[start:start + n].copy()
        return _Request(request, asyncio.get_running_loop().create_future(), ids, logprobs, stops)

    async def end_session(self, session_id: str) -> None:
        """Forget what ``session_id``'s last turn left for its next (`SimSessions`); unknown ids are ignored."""
        self._sessions.end(session_id)

    async def abort(self, request_ids: Iterable[str]) -> None:
        """End the named requests now with their partial output; unknown ids are ignored."""
        wanted = set(request_ids)
        now = self._clock.now()
        for r in [r for r in self._queued if r.rid in wanted]:
            self._queued.remove(r)
            self._finish(r, 0, "abort")
        for rid in wanted & self._running.keys():
            r = self._running[rid]
            self._finish(r, r.generated(now), "abort")
        if self._task is not None:
            self._start()  # freed slots go to queued requests

    def progress(self, request_ids: Iterable[str]) -> dict[str, int]:
        """Tokens generated so far by each named request in flight (0 while queued)."""
        now = self._clock.now()
        out = {}
        for rid in request_ids:
            r = self._running.get(rid)
            if r is not None:
                out[rid] = r.generated(now)
            elif rid in self._in_flight:  # in flight and not running: queued
                out[rid] = 0
        return out

    # ---------------------------------------------------------------- pause / resume

    async def pause(self, mode: PauseMode = "keep", clear_cache: bool = False) -> None:
        """Pause with vLLM's ``abort`` | ``wait`` | ``keep``; returns once the mode holds."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._check_open()
        self._paused = mode
        if mode == "wait":
            deadline = time.monotonic() + self.config.pause_timeout_s
            while (self._running or self._queued) and not self._closed:
                self._finished.clear()
                try:
                    await asyncio.wait_for(self._finished.wait(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise EngineError(f"pause('wait') did not drain {len(self._running)} running and "
                                      f"{len(self._queued)} queued requests within "
                                      f"pause_timeout_s={self.config.pause_timeout_s}") from None
        self._clock.freeze()
        now = self._clock.now()
        if mode == "abort":
            while self._queued:
                self._finish(self._queued.popleft(), 0, "abort")
            for r in list(self._running.values()):
                self._finish(r, r.generated(now), "abort")
        if clear_cache:
            self._sessions.clear()
            for r in self._running.values():
                self._counters["reprefill_tokens"] += len(r.request.prompt_ids) + r.generated(now)

    async def resume(self) -> None:
        """Frozen requests continue from the same token; queued ones are admitted."""
        self._check_open()
        self._paused = None
        self._clock.run()
        self._start()

    # ---------------------------------------------------------------- weights

    def param_meta(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """No model: a weight sync to a simulated engine carries no tensors."""
        return []

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._paused is None:
            raise EngineError("load_weights while generating: pause() first")
        for _ in named_tensors:
            pass
        self._counters["weight_loads"] += 1

    async def finish_weight_update(self, version: int) -> None:
        """Make the loaded weights live as ``version``: tokens from the next step on carry it."""
        self._version = int(version)
        now = self._clock.now()
        # Marks before the oldest running request's start name no token any more (bounded over a long run).
        oldest = min((r.start for r in self._running.values()), default=now)
        keep = max(i for i, (step, _) in enumerate(self._marks) if step <= oldest or i == 0)
        self._marks = [*self._marks[keep:], (now, self._version)]

    # ---------------------------------------------------------------- stats

    def stats(self) -> dict[str, int]:
        """running, queued, requests, tokens_generated, kv_tokens, reprefill_tokens, prefill_tokens, weight_loads, version."""
        now = self._clock.now()
        kv = sum(len(r.request.prompt_ids) + r.generated(now) for r in self._running.values())
        return dict(running=len(self._running), queued=len(self._queued), kv_tokens=kv, version=self._version,
                    session_live=len(self._sessions), **self._counters, **self._sessions.counters)

    # ---------------------------------------------------------------- scheduler

    async def _schedule(self) -> None:
        while True:
            self._wake.clear()
            wait = None
            if self._paused in (None, "wait"):  # keep and abort: the clock stands still
                self._complete_due()
                self._admit()  # into the slots the finished ones freed
                if self._due:
                    wait = self._clock.seconds_until(self._due[0][0])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    def _admit(self) -> None:
        for r in [r for r in self._running.values() if r.future.done()]:  # callers that were cancelled
            del self._running[r.rid]
            self._in_flight.discard(r.rid)
        now = self._clock.now()
        while self._queued and len(self._running) < self.config.max_running:
            r = self._queued.popleft()
            if r.future.done():  # a cancelled caller's request is dropped here
                self._in_flight.discard(r.rid)
                continue
            new = self._sessions.new_tokens(r.request.session_id, self._version, r.request.prompt_ids)
            self._counters["prefill_tokens"] += new
            r.start = now + self._prefill_steps(new)
            self._running[r.rid] = r
            self._tie += 1
            heapq.heappush(self._due, (r.start + len(r.ids), self._tie, r))

    def _prefill_steps(self, tokens: int) -> float:
        rate = self.config.prefill_tokens_per_s
        return 0.0 if rate is None else tokens / rate / self.config.step_s

    def _complete_due(self) -> None:
        now = self._clock.now()
        while self._due and self._due[0][0] <= now + 1e-9:
            _, _, r = heapq.heappop(self._due)
            if self._running.get(r.rid) is r:
                self._finish(r, len(r.ids), "stop" if r.stops else "length")

    def _finish(self, r: _Request, n: int, reason: str) -> None:
        if self._running.get(r.rid) is r:
            del self._running[r.rid]
        self._in_flight.discard(r.rid)
        self._counters["tokens_generated"] += n
        self._finished.set()
        if r.request.session_id is not None and reason in ("stop", "length"):  # its KV, for the session's next turn
            self._sessions.keep(r.request.session_id, self._version, r.request.prompt_ids, r.ids[:n])
        if r.future.done():
            return
        # Token i is done at step start + i + 1, with the weights of the last update before then (an
        # update lands while the clock is frozen, so the token in progress at the pause gets the new one).
        steps, versions = zip(*self._marks)
        at = np.searchsorted(np.asarray(steps), r.start + np.arange(1, n + 1) - 1e-9, side="left") - 1
        versions = np.asarray(versions, dtype=np.int64)[at]
        r.future.set_result(GenerateResult(r.rid, r.ids[:n], r.logprobs[:n], versions, reason))


_TABLE_OFFSETS = 4096
"""Distinct windows of an engine's token table a response can start at."""


def _stable_hash(text: str) -> int:
    """A seed from a request id that is the same in every process (``hash`` is salted per process)."""
    return zlib.crc32(text.encode())
