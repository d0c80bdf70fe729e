"""The Rollouter: feed prompts, generate ``n`` responses each on the engines, reward, send groups.

One asyncio loop, one task group::

    feed loop ─► staleness gate ─► one task per prompt ─► n requests, each to the least-loaded
    engine ─► reward each response (off the loop) ─► Group ─► StreamProducer.send (awaits credit)
         ▲                                  │ truncated (partial rollout)
         └─ partial buffer, highest age ◄───┘ first, released at the next weight sync

- ``sample_id`` is ``sample_{epoch}_{index}``; ``index`` is the feed order at admission, and
  it continues across epochs and across a resume (`RolloutState.next_index`).
- Resume: a checkpoint stores the feed position; the ids admitted before it but not yet
  trained (in flight, or sent and not acked) are the feed indices below ``next_index`` that
  the Trainer's committed set lacks. A resumed Rollouter regenerates them by id
  (`RolloutState.pending`, served first, same ``sample_id`` and sampling seeds) before new
  ids continue from ``next_index``; ``admitted`` continues from the groups already done. The
  partial buffer is saved too (``partials`` in the snapshot): a response truncated before the
  checkpoint continues after the resume from its saved parts (tokens, behaviour log-probs,
  versions, age), served with its pending group; only a part being generated at the crash,
  and the finished responses of unfinished groups, are generated again.
- `stop` drains: no new admissions, in-flight groups are cancelled and their requests aborted
  on the engines (a resume regenerates them), and `run` returns.
- Staleness gate (verl's fully-async knobs): after ``version`` weight syncs the Trainer will
  have consumed ``version * groups_per_sync`` groups; the Rollouter admits a new prompt only
  while ``admitted - given_back < (version + 1 + staleness_threshold) * groups_per_sync`` and
  fewer than ``max_concurrent`` prompts are in flight. ``given_back`` counts groups that will
  never be trained: failed ones, and those the Trainer dropped by policy (it says so through
  `on_dropped`). ``staleness_threshold=0`` with one step per sync is on-policy: generate a
  batch, train, sync, in lockstep. The Rollouter learns of a sync through `on_pause` (before)
  and `on_sync` (after), called by whoever runs the weight sync.
- Partial rollout (`asyncrl.rollouter.partial`): with an `AggregatorActor`, a round's
  unfinished requests are stopped when the round ends; each waits in the partial buffer for
  the next round and resumes from prompt + partial response. ``truncate_at="threshold"``
  (sync mode, the RFC's workflow): the gate admits no count of prompts but keeps ``max_concurrent``
  prompts in flight while the round is open; the round ends once the aggregator has counted
  the complete groups the Trainer's step still lacks (``(version + 1) * groups_per_sync``
  less the usable groups finished so far, set at each `on_sync`), and no prompt is admitted
  after that until the next sync. ``truncate_at="sync"`` (async mode): the engines truncate
  in place at each weight sync (they drop the KV cache of what they keep, and re-read prompt +
  partial response under the new weights when they resume); the Rollouter sees nothing of it.
  Without partial rollout, in-flight requests are paused and kept through each sync by the
  engines, KV cache and all.
- ``request_timeout_s`` counts only time outside weight-sync pauses; a request past it is
  aborted on its engine, and fails its group.
- A response that fails (engine error, dead engine, timeout) fails its whole group, which is
  still sent, with ``status="failed"`` and the error: the Trainer fails closed on it (or drops
  and counts it). An engine whose actor died gets no further requests: its requests go again,
  same seed, to a live engine; only when none is left do they fail.
- `generate_group` only generates; the send is separate, so the ``async_rollout`` skip role
  (`asyncrl.skip`) can answer a sample from a dump and the group is still sent as usual.
  The process that runs the Rollouter calls `SkipManager.init` (the registry is per process).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.rollouter.partial import PartialBuffer, PartialResponse, PartialRolloutConfig
from asyncrl.skip import SkipManager, is_replayed
from asyncrl.types import (CommittedSet, GenerateRequest, GenerateResult, Group, SamplingParams, Trajectory,
                           make_sample_id, parse_sample_id)

log = logging.getLogger("asyncrl.rollouter")


@dataclass(kw_only=True)
class RolloutConfig:
    """Settings of the Rollouter."""

    n: int = 8
    """Responses per prompt (the group size)."""
    max_tokens: int = 8
    """Response budget per request (a prompt may carry its own, `Prompt.max_tokens`)."""
    temperature: float = 1.0
    """Sampling temperature (behaviour logprobs are taken after it)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 disables it."""
    top_k: int = 0
    """Top-k sampling; 0 disables it."""
    groups_per_sync: int = 8
    """Groups the Trainer consumes between two weight syncs (`TrainerConfig.groups_per_sync`)."""
    staleness_threshold: float = 0.0
    """Extra fraction of ``groups_per_sync`` that may be generated ahead of the next sync."""
    max_concurrent: int = 16
    """Prompts in flight at once across all engines."""
    request_timeout_s: float = 600.0
    """Deadline of one generate call, not counting weight-sync pauses; past it the request is
    aborted on its engine and fails its group."""
    reward_workers: int = 4
    """Threads that run a synchronous reward function (an async one is awaited instead)."""
    seed: int = 0
    """Base seed; request ``k`` of sample ``i`` samples with ``seed + 1000 * i + k`` (+ its age)."""

    def __post_init__(self) -> None:
        for name in ("n", "max_tokens", "groups_per_sync", "max_concurrent", "reward_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.staleness_threshold < 0:
            raise ValueError(f"RolloutConfig.staleness_threshold must be >= 0, got {self.staleness_threshold}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"RolloutConfig.request_timeout_s must be > 0, got {self.request_timeout_s}")


@dataclass
class RolloutState:
    """Where the feed stands: what the Rollouter checkpoints and resumes from."""

    epoch: int = 0
    next_index: int = 0
    """Feed index of the next new prompt (never restarts)."""
    position: int = 0
    """Row of the current epoch to feed next."""
    pending: list[int] = field(default_factory=list)
    """Feed indices below ``next_index`` to generate (again) before any new one: admitted
    before a checkpoint and not trained by it (a resume fills this)."""
    done: int = 0
    """Groups already trained or dropped (before a resume): they count as admitted and sent."""
    dropped: int = 0
    """Of ``done``, how many were dropped: like failed groups they give their budget back."""
    partials: dict[str, dict[int, PartialResponse]] = field(default_factory=dict)
    """Truncated responses of pending samples saved by a checkpoint (``sample_id -> {k: parts}``):
    each continues from its parts instead of starting over."""

    @classmethod
    def resume(cls, saved: dict, committed: CommittedSet, dropped: int, rows: int) -> RolloutState:
        """Where a resumed Rollouter starts, from a checkpoint: its feed position ``saved`` (a
        `Rollouter.snapshot`), the Trainer's ``committed`` set and ``dropped`` count, over a
        dataset of ``rows`` prompts. Every feed index below ``next_index`` that is not committed
        was admitted and not trained: it becomes ``pending``. A feed position older than the
        committed set (saved before the Rollouter died) moves up past the highest committed id.
        """
        st = cls(epoch=int(saved.get("epoch", 0)), next_index=int(saved.get("next_index", 0)),
                 position=int(saved.get("position", 0)))
        top = committed.max_index() + 1
        if top > st.next_index:
            st.epoch, st.position = divmod(st.epoch * rows + st.position + top - st.next_index, rows)
            st.next_index = top
        st.pending = committed.missing(st.next_index)
        st.done, st.dropped = len(committed), dropped
        pending = set(st.pending)
        for sample_id, responses in saved.get("partials", {}).items():
            if parse_sample_id(sample_id)[1] in pending:  # a trained or dropped sample needs no parts
                st.partials[sample_id] = {int(k): PartialResponse.from_json(r) for k, r in responses.items()}
        return st


@dataclass
class Prompt:
    """One dataset row, encoded."""

    text: str
    prompt_ids: np.ndarray
    meta: dict = field(default_factory=dict)
    max_tokens: int | None = None
    """This prompt's response budget; None takes `RolloutConfig.max_tokens`."""


@dataclass
class RolloutStats:
    """Counters and timers of the Rollouter (for the step metrics)."""

    gate_blocked_s: float = 0.0
    """Time the feed loop waited at the staleness gate (or for a concurrency slot)."""
    credit_blocked_s: float = 0.0
    """Time finished groups waited for stream credit (summed over groups)."""
    idle_s: float = 0.0
    """Time with no request in flight on any engine."""
    truncated: int = 0
    """Responses stopped by a round's truncation (a response stopped twice counts twice)."""
    resumed: int = 0
    """Truncated responses dispatched again."""
    timed_out: int = 0
    """Requests aborted past ``request_timeout_s``."""
    dead_engines: int = 0


GC_YOUNG_THRESHOLD = 20_000
"""Allocations between collections of Python's youngest generation in the Rollouter's process (`settle_gc`)."""


def settle_gc() -> None:
    """Keep the garbage collector from pausing a busy Rollouter's event loop.

    Each request allocates futures, tasks and arrays that live for its lifetime. Under Python's
    default thresholds (700 allocations) they outlive several young collections, reach the
    oldest generation, and make full collections of the whole heap (modules, tokenizer, dataset
    included) run about once a second: at 128 simulated replicas 1.5 s of 7 s went to them, up to
    190 ms at once (``scripts/bench_scale.py``). Call once the process is set up: what exists now
    is frozen out of every later collection (`gc.freeze`), and the youngest generation is
    collected every ``GC_YOUNG_THRESHOLD`` allocations, so most per-request objects die before
    a collection sees them. Reference cycles are still collected.
    """
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 100)


_ADMIT_BURST = 64
"""Groups the feed admits in one turn of the event loop before it lets other work run."""


class _EngineDied(RuntimeError):
    """The engine replica's actor is gone."""

class Rollouter:
    """Generates groups from ``prompts`` on ``engines`` and sends them on ``producer``.

    ``engines`` are EngineActor handles (``.generate.remote``) or in-process engines
    (awaitable ``generate``); ``reward_fn(prompt, response_ids) -> float`` (or an awaitable of
    one) gets the `Prompt` (its text and row meta) and the response's token ids; a synchronous
    one runs on the Rollouter's reward threads, off its event loop.
    ``partial`` turns partial rollout on; with ``truncate_at="threshold"`` it needs ``aggregator``
    (an `AggregatorActor` handle or instance); with ``truncate_at="sync"`` the engines truncate
    at each weight sync themselves (the coordinator's ``clear_cache``) and the Rollouter does
    nothing of its own.
    """

    def __init__(self, cfg: RolloutConfig, engines: Sequence[Any], producer: Any, prompts: Sequence[Prompt],
                 reward_fn: Callable[[Prompt, np.ndarray], float | Awaitable[float]], *, state: RolloutState | None = None,
                 partial: PartialRolloutConfig | None = None, aggregator: Any = None):
        if not engines:
            raise ValueError("Rollouter needs at least one engine")
        if not prompts:
            raise ValueError("Rollouter needs a non-empty dataset")
        self.partial = partial or PartialRolloutConfig()
        if self.partial.by_count and aggregator is None:
            raise ValueError("partial_rollout.truncate_at='threshold' needs an aggregator (AggregatorActor over the engines)")
        self.cfg = cfg
        self.engines = list(engines)
        self.producer = producer
        self.prompts = list(prompts)
        self.reward_fn = reward_fn
        self.aggregator = aggregator if self.partial.by_count else None
        self.state = state or RolloutState()
        self.version = 0
        self.admitted = self.sent = self.state.done
        self.failed = 0
        self.given_back: set[str] = set()
        """sample_ids that will never be trained (failed, or dropped by the Trainer)."""
        self.partials = PartialBuffer()
        self.stats = RolloutStats()
        self.replayed = 0
        """Groups the ``async_rollout`` skip role answered from dumps (no engine request)."""
        self._load = [0] * len(self.engines)
        self._live = list(range(len(self.engines)))
        """Replicas not known dead, in index order (dispatch takes the least loaded, lowest index first)."""
        self._gate = asyncio.Condition()
        self._groups: dict[str, asyncio.Task] = {}  # sample_id admitted and not yet sent -> its task
        self._requests: dict[str, int] = {}  # request_id in flight -> engine index
        self._truncated: dict[str, dict[int, PartialResponse]] = {
            sid: dict(responses) for sid, responses in self.state.partials.items()}
        """Truncated responses not yet finished, of groups not yet sent: what `snapshot` saves."""
        self._stopping = False
        self._lockstep = self.aggregator is not None
        """The RFC's synchronous workflow: rounds end by count and admit until they do."""
        self._round_closed = False
        self._round_opened = False
        self._finished = 0
        """Groups this run generated or replayed (complete or failed), counted before their send."""
        self._where(self.state.next_index)  # the state must fit the dataset
        for index in self.state.pending:
            if not 0 <= index < self.state.next_index:
                raise ValueError(f"RolloutState.pending holds {index}, not below next_index={self.state.next_index}")
            self._where(index)
        self._paused_at: float | None = None
        self._paused_total = 0.0
        self._in_flight = 0
        self._idle_since: float | None = time.monotonic()
        self._reward_pool: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ control

    async def on_pause(self) -> None:
        """A weight sync is about to pause the engines: stop the request clocks."""
        if self._paused_at is None:
            self._paused_at = time.monotonic()

    async def on_sync(self, version: int) -> None:
        """The engines now serve ``version``: restart the clocks, release truncated responses
        (highest age first), then open the staleness gate accordingly."""
        if self._paused_at is not None:
            self._paused_total += time.monotonic() - self._paused_at
            self._paused_at = None
        async with self._gate:
            if version > self.version:
                self.version = version
                if self._lockstep:
                    await self._open_round()
                self.partials.release(version)
            self._gate.notify_all()

    async def replace_engine(self, index: int, engine: Any) -> None:
        """Replica ``index`` was started again (it holds the current weights): requests go to it again."""
        self.engines[index] = engine  # (its load counts calls in flight: those to the dead one end on their own)
        if index not in self._live:
            self._live = sorted([*self._live, index])

    async def on_dropped(self, sample_ids: Iterable[str]) -> None:
        """The Trainer dropped these groups by policy: their budget goes back to the gate."""
        async with self._gate:
            before = len(self.given_back)
            self.given_back.update(sample_ids)
            if self._lockstep and self._round_opened and len(self.given_back) > before:
                await self._open_round(at_least_one=False)  # the step lacks them now: the round goes on
            self._gate.notify_all()

    async def _open_round(self, at_least_one: bool = True) -> None:
        """(Re)open the lockstep round of ``version``: it ends once it counts the complete groups
        the Trainer's step still lacks (and ``partial.threshold`` trajectories, when set)."""
        usable = self.state.done - self.state.dropped + self._finished - len(self.given_back)
        lacking = (self.version + 1) * self.cfg.groups_per_sync - usable
        if lacking <= 0 and not at_least_one:
            return
        # A new round counts at least one group, so what resumes in it makes progress before
        # the next truncation (surplus groups from a race at the last round's end go first).
        need = max(lacking, 1) * self.cfg.n
        await _invoke(self.aggregator, "start_round", self.version, max(need, self.partial.threshold or 0))
        self._round_closed, self._round_opened = False, True

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Drain: admit nothing more, cancel in-flight groups, abort their requests on the engines.

        `run` returns once its tasks are gone. Groups already sent stay with the producer (unacked)."""
        async with self._gate:
            self._stopping = True
            self._gate.notify_all()
        for task in list(self._groups.values()):
            task.cancel()
        by_engine: dict[int, list[str]] = {}
        for request_id, e in self._requests.items():
            by_engine.setdefault(e, []).append(request_id)
        aborts = [_invoke(self.engines[e], "abort", ids) for e, ids in by_engine.items()]
        results = await asyncio.wait_for(asyncio.gather(*aborts, return_exceptions=True), timeout_s)
        for e, result in zip(by_engine, results):
            if isinstance(result, BaseException):
                log.warning("engine %d did not abort its requests at stop: %s", e, result)

    def snapshot(self) -> dict:
        """The feed state for a checkpoint (JSON-able): position, plus the ids admitted and not yet
        sent (``in_flight``) and sent but not acked (``unacked``, when the producer tells)."""
        unacked = getattr(self.producer, "unacked", None)
        return {
            "epoch": self.state.epoch, "next_index": self.state.next_index, "position": self.state.position,
            "in_flight": sorted(self._groups, key=_index_of),
            "unacked": [g.sample_id for g in unacked] if unacked is not None else [],
            "partials": {sid: {str(k): parts.to_json() for k, parts in responses.items()}
                         for sid, responses in self._truncated.items() if responses},
        }

    def _admissible(self) -> bool:
        if self._lockstep:  # the round, not a count, bounds what is admitted
            return (not self._round_closed and self.admitted - self.sent < self.cfg.max_concurrent
                    and self.partials.undispatched == 0)
        budget = (self.version + 1 + self.cfg.staleness_threshold) * self.cfg.groups_per_sync
        # Groups dropped before a resume gave their budget back too.
        return (self.admitted - len(self.given_back) - self.state.dropped < budget
                and self.admitted - self.sent < self.cfg.max_concurrent
                and self.partials.undispatched == 0)  # released partials go before new prompts

    def _active_time(self) -> float:
        """Monotonic time that stands still while the engines are paused for a weight sync."""
        now = time.monotonic()
        return now - self._paused_total - (now - self._paused_at if self._paused_at is not None else 0.0)

    # ------------------------------------------------------------------ feed

    def _where(self, index: int) -> tuple[int, int]:
        """``(epoch, row)`` of feed index ``index``: the feed walks the rows in order, epoch after epoch."""
        n, st = len(self.prompts), self.state
        offset = st.epoch * n + st.position + index - st.next_index
        if offset < 0 or st.position > n:
            raise ValueError(f"feed index {index} does not fit RolloutState(epoch={st.epoch}, position={st.position}, "
                             f"next_index={st.next_index}) over a dataset of {n} rows (a different dataset?)")
        return divmod(offset, n)

    def _draw(self) -> tuple[str, Prompt]:
        """The next prompt to admit: a pending one (a resume's) first, then the next new one."""
        st = self.state
        index = st.pending.pop(0) if st.pending else st.next_index
        epoch, row = self._where(index)
        if index == st.next_index:
            st.epoch, st.position = self._where(index + 1)
            st.next_index += 1
        return make_sample_id(epoch, index), self.prompts[row]

    async def run(self, num_groups: int | None = None) -> None:
        """Feed prompts until ``num_groups`` more groups were admitted (forever when None), or `stop`."""
        if self._reward_pool is None:
            self._reward_pool = concurrent.futures.ThreadPoolExecutor(self.cfg.reward_workers,
                                                                      thread_name_prefix="asyncrl-reward")
        stop_at = None if num_groups is None else self.admitted + num_groups
        if self._lockstep and not self._round_opened:
            async with self._gate:
                await self._open_round()
        burst = 0
        try:
            async with asyncio.TaskGroup() as tg:
                while stop_at is None or self.admitted < stop_at:
                    t0 = time.monotonic()
                    async with self._gate:
                        await self._gate.wait_for(lambda: self._stopping or self._admissible())
                        if self._stopping:
                            break
                        # Draw only once admitted: every index below next_index was admitted.
                        sample_id, prompt = self._draw()
                        self.admitted += 1
                        self._groups[sample_id] = tg.create_task(self._one_group(sample_id, prompt))
                    self.stats.gate_blocked_s += time.monotonic() - t0
                    # A sync opens the gate for a whole step at once: start its groups a few at a time,
                    # one event-loop turn apart, so a pause or resume waits behind a few groups' start.
                    burst += 1
                    if burst % _ADMIT_BURST == 0:
                        await asyncio.sleep(0)
        finally:
            self._reward_pool.shutdown(wait=False, cancel_futures=True)
            self._reward_pool = None

    # ------------------------------------------------------------------ one prompt

    async def _one_group(self, sample_id: str, prompt: Prompt) -> None:
        try:
            group = await self.generate_group(sample_id, prompt)
            self._finished += 1
            t0 = time.monotonic()
            await self.producer.send(group)
            self._truncated.pop(sample_id, None)  # its parts are in the group now (or it failed)
            self.stats.credit_blocked_s += time.monotonic() - t0
            async with self._gate:
                self.sent += 1
                self.replayed += is_replayed(group)
                if group.status == "failed":
                    self.failed += 1
                    self.given_back.add(sample_id)  # never trained: its budget goes back
                self._gate.notify_all()
        finally:
            self._groups.pop(sample_id, None)  # sent, or cancelled by stop()

    @SkipManager.annotate(role="async_rollout")
    async def generate_group(self, sample_id: str, prompt: Prompt) -> Group:
        """The ``n`` scored responses to ``prompt`` as one group (failed if any response failed).

        Generation only, nothing is sent: the ``async_rollout`` skip role may answer it from a
        dump of this ``sample_id``'s feed index instead of the engines. A complete group is
        reported to the aggregator (partial rollout), split by the replica that finished each
        response.
        """
        _, index = parse_sample_id(sample_id)
        outcomes = await asyncio.gather(
            *(self._one_response(sample_id, index, k, prompt) for k in range(self.cfg.n)),
            return_exceptions=True,
        )
        for k, o in enumerate(outcomes):  # the rewards, started as each response ended; most are done by now
            if isinstance(o, tuple):
                try:
                    o[0].reward = await _reward_of(o[2])
                except Exception as exc:
                    outcomes[k] = exc
        errors = [f"{k}: {type(o).__name__}: {o}" for k, o in enumerate(outcomes) if isinstance(o, BaseException)]
        trajectories = [o[0] for o in outcomes if isinstance(o, tuple)]
        meta = {"prompt": prompt.text, **prompt.meta}
        if errors:
            return Group(sample_id=sample_id, trajectories=trajectories, expected=self.cfg.n, status="failed",
                         error="; ".join(errors), meta=meta)
        group = Group(sample_id=sample_id, trajectories=trajectories, expected=self.cfg.n, meta=meta)
        if self._lockstep and group.complete:
            per_replica: dict[int, int] = {}
            for _, replica, _ in outcomes:
                per_replica[replica] = per_replica.get(replica, 0) + 1
            version = self.version
            if await _invoke(self.aggregator, "report", version, per_replica) and version == self.version:
                self._round_closed = True  # the step has its groups: admit nothing until the sync
        return group

    async def _one_response(self, sample_id: str, index: int, k: int, prompt: Prompt) -> tuple[Trajectory, int, Any]:
        """One response, resumed across truncations; returns it with the replica that finished it
        and its reward under way (`_start_reward`)."""
        cfg = self.cfg
        budget = prompt.max_tokens or cfg.max_tokens
        parts = self._truncated.get(sample_id, {}).get(k)
        resuming = parts is not None  # only a resume puts parts there before this call
        parts = parts or PartialResponse()
        owed = False  # released by the partial buffer (counted undispatched there) and not yet dispatched
        while True:
            truncatable = self.aggregator is not None and parts.age < self.partial.max_age
            if truncatable and self._round_closed:
                # The round ended before this went out (its engines idle until the sync): wait for the next.
                if owed:
                    self.partials.dispatched()
                await self.partials.wait(parts.age, self.version)
                owed = True
                continue
            ids, _, _ = parts.joined()
            request = GenerateRequest(
                request_id=f"{sample_id}/{k}" + (f"/{parts.age}" if parts.age else ""),
                prompt_ids=np.concatenate([prompt.prompt_ids, ids]) if len(ids) else prompt.prompt_ids,
                max_tokens=budget - len(ids),
                sampling=SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                        seed=cfg.seed + 1000 * index + k + 7919 * parts.age),
            )
            if owed:
                self.partials.dispatched()
                owed = False
            if resuming:
                self.stats.resumed += 1
                resuming = False
            dispatched_in = self.version
            result, replica = await self._generate(request, truncatable)
            parts.add(result)
            if result.finish_reason != "truncated" or parts.n_tokens >= budget:
                break
            if len(result.response_ids):  # stopped with tokens: one more truncation survived
                parts.age += 1
                self.stats.truncated += 1
                self._truncated.setdefault(sample_id, {})[k] = parts
                resuming = True
            # (Stopped before its first token, by the synchronous workflow's round end: it waits
            # for the next round as it was.) The round it was stopped in: never later than its
            # last token's version or the round it was sent in (a later guess could wait for a
            # sync that needs this group).
            stopped_in = int(result.versions[-1]) if len(result.versions) else dispatched_in
            if stopped_in >= self.version:
                await self.partials.wait(parts.age, stopped_in)
            else:
                self.partials.undispatched += 1  # its next round has begun already: go now
            owed = True
        self._truncated.get(sample_id, {}).pop(k, None)  # finished: a resume would generate it again
        response_ids, logprobs, versions = parts.joined()
        finish = result.finish_reason if result.finish_reason != "truncated" else "length"
        trajectory = Trajectory(
            sample_id=sample_id, index=k, prompt_ids=prompt.prompt_ids, response_ids=response_ids,
            logprobs=logprobs, versions=versions, finish_reason=finish, age=parts.age,
        )
        return trajectory, replica, self._start_reward(prompt, response_ids)

    def _start_reward(self, prompt: Prompt, response_ids: np.ndarray) -> asyncio.Task | concurrent.futures.Future:
        """Start the response's reward off the event loop: a coroutine function as a task, a plain
        one on the reward threads. The group reads it once its last response ends (`_reward_of`),
        so a plain reward costs the event loop no wake-up of its own."""
        if inspect.iscoroutinefunction(self.reward_fn):
            return asyncio.ensure_future(self.reward_fn(prompt, response_ids))
        return self._reward_pool.submit(self.reward_fn, prompt, response_ids)

    async def _generate(self, request: GenerateRequest, truncatable: bool) -> tuple[GenerateResult, int]:
        """Run ``request`` on the least-loaded live engine under the (pause-aware) deadline; if that
        engine's actor or engine process dies, again (same seed) on another live one."""
        while True:
            if not self._live:
                raise _EngineDied(f"{request.request_id}: every engine replica is dead")
            e = min(self._live, key=self._load.__getitem__)
            self._load[e] += 1
            self._busy(+1)
            self._requests[request.request_id] = e
            call = asyncio.ensure_future(_call(self.engines[e], request, truncatable))
            try:
                timeout, start = self.cfg.request_timeout_s, self._active_time()
                while not call.done():
                    left = timeout - (self._active_time() - start)
                    if left <= 0:
                        await self._abort_timed_out(e, request, call)
                    await asyncio.wait({call}, timeout=left)
                return call.result(), e
            except Exception as exc:
                if not _actor_died(exc):
                    raise
                if e in self._live:
                    self._live.remove(e)
                    self.stats.dead_engines += 1
                    log.error("engine replica %d died (%r); no further requests go to it", e, exc)
            finally:
                call.cancel()
                self._load[e] -= 1
                self._busy(-1)
                self._requests.pop(request.request_id, None)

    async def _abort_timed_out(self, e: int, request: GenerateRequest, call: asyncio.Future) -> None:
        self.stats.timed_out += 1
        try:
            await asyncio.wait_for(_invoke(self.engines[e], "abort", [request.request_id]), 30.0)
            await asyncio.wait_for(asyncio.shield(call), 30.0)
        except Exception:  # the engine may be gone; the timeout is the error that matters
            pass
        raise TimeoutError(f"{request.request_id}: no result within request_timeout_s={self.cfg.request_timeout_s} "
                           "(time paused for weight syncs not counted); aborted on its engine")

    def stats_now(self) -> dict:
        """`RolloutStats` as a dict, the idle span in progress included, with ``time_s`` (monotonic)."""
        now = time.monotonic()
        out = {k: getattr(self.stats, k) for k in self.stats.__dataclass_fields__}
        if self._in_flight == 0 and self._idle_since is not None:
            out["idle_s"] += now - self._idle_since
        out.update(time_s=now, waiting_partials=len(self.partials))
        return out

    def _busy(self, delta: int) -> None:
        now = time.monotonic()
        if self._in_flight == 0 and self._idle_since is not None:
            self.stats.idle_s += now - self._idle_since
            self._idle_since = None
        self._in_flight += delta
        if self._in_flight == 0:
            self._idle_since = now


async def _reward_of(pending: asyncio.Task | concurrent.futures.Future) -> float:
    """The value of a reward `Rollouter._start_reward` started (awaited only if not done yet)."""
    if isinstance(pending, concurrent.futures.Future):
        value = pending.result() if pending.done() else await asyncio.wrap_future(pending)
    else:
        value = await pending
    return float(await value if inspect.isawaitable(value) else value)


async def _call(engine: Any, request: GenerateRequest, truncatable: bool = False) -> GenerateResult:
    args = (request, truncatable) if truncatable else (request,)
    remote = getattr(engine.generate, "remote", None)
    if remote is not None:
        return await remote(*args)
    return await engine.generate(*args)


async def _invoke(target: Any, method: str, *args: Any) -> Any:
    """``target.method(*args)`` on a Ray actor handle or an in-process object, awaited."""
    fn = getattr(target, method)
    remote = getattr(fn, "remote", None)
    out = remote(*args) if remote is not None else fn(*args)
    return await out if inspect.isawaitable(out) else out


def _index_of(sample_id: str) -> int:
    return parse_sample_id(sample_id)[1]


def _actor_died(exc: BaseException) -> bool:
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


def encode_prompts(tokenizer, rows: Iterable[dict], encode: Callable[[Any, str], np.ndarray] | None = None) -> list[Prompt]:
    """Rows with a ``prompt`` text column (verl's convention) -> `Prompt`s."""
    out = []
    for i, row in enumerate(rows):
        text = row.get("prompt")
        if not isinstance(text, str):
            raise ValueError(f"dataset row {i}: needs a 'prompt' column of text, got {type(text).__name__}")
        ids = encode(tokenizer, text) if encode else np.asarray(tokenizer(text)["input_ids"], dtype=np.int64)
        out.append(Prompt(text=text, prompt_ids=ids))
    return out
