"""The Rollouter: feed prompts, generate ``n`` responses each on the engines, reward, send groups.

One asyncio loop, one task group::

    feed loop ─► staleness gate ─► one task per prompt ─► its n requests in one call to one engine
    replica ─► reward each response as it ends (off the loop) ─► Group ─► StreamProducer.send
         ▲                                  │ truncated (partial rollout)    (awaits credit)
         └─ partial buffer, highest age ◄───┘ first, released at the next weight sync

The feed is `asyncrl.rollouter.feed` (order, ``sample_id``, the position a checkpoint saves),
the dispatch `asyncrl.rollouter.pool` (a group's requests in one call to the replica it sticks
to, deadlines, dead replicas: ``request_timeout_s`` counts no weight-sync pause), rewards
`asyncrl.rollouter.rewards`, what bounds the admissions by mode `asyncrl.rollouter.admission`;
here are the feed loop and group assembly.

- Resume: the feed serves the ids admitted and not trained first (`RolloutState`); ``admitted``
  continues from the groups done. A response truncated before the checkpoint (``partials`` in
  the snapshot) continues from its saved parts, served with its pending group.
- `stop` drains: no new admissions, in-flight groups are cancelled and their requests aborted
  on the engines (a resume regenerates them), and `run` returns.
- Staleness gate (async mode, `StalenessGate`; verl's fully-async knobs): after ``version``
  weight syncs the Trainer will have consumed ``version * groups_per_sync`` groups; the
  Rollouter admits a new prompt only while ``admitted - given_back < (version + 1 +
  staleness_threshold) * groups_per_sync`` and fewer than ``max_concurrent`` prompts are in
  flight. ``given_back`` counts groups that will never be trained: failed ones, those the group
  filter dropped (at once, before their send), and those the Trainer dropped by policy
  (`on_dropped`). ``staleness_threshold=0`` with one step per sync is on-policy: generate a
  batch, train, sync, in lockstep. The Rollouter learns of a sync through `on_pause` (before)
  and `on_sync` (after), called by whoever runs the weight sync.
- Partial rollout (`asyncrl.rollouter.partial`): with an `AggregatorActor`, a round's
  unfinished requests are stopped when the round ends; each waits in the partial buffer for
  the next round and resumes from prompt + partial response. ``truncate_at="threshold"``
  (sync mode, the RFC's workflow; `LockstepRounds`): the gate admits no count of prompts but keeps ``max_concurrent``
  prompts in flight while the round is open; the round ends once the aggregator has counted
  the complete groups the Trainer's step still lacks (``(version + 1) * groups_per_sync``
  less the usable groups finished so far, set at each `on_sync`), and no prompt is admitted
  after that until the next sync. ``truncate_at="sync"`` (async mode): the engines truncate
  in place at each weight sync (they drop the KV cache of what they keep, and re-read prompt +
  partial response under the new weights when they resume); the Rollouter sees nothing of it.
  Without partial rollout, in-flight requests are paused and kept through each sync by the
  engines, KV cache and all.
- A response that fails (engine error, dead engine, timeout) fails its whole group, which is
  still sent, with ``status="failed"`` and the error: the Trainer fails closed on it (or drops
  and counts it). An engine whose actor died gets no further requests: the call's unfinished
  requests go again together, same seeds, to a live engine; only when none is left do they fail.
- The user's code raising (env, loop, reward, filter) is a `UserCodeError`, no fault: ``on_user_error``
  ``stop`` ends `run` with it, ``drop`` sends its group marked, never trained (`asyncrl.usercode`).
- Agent loops (`asyncrl.rollouter.agents`, ``rollout.agent``): each response is one run of the
  loop, every turn a request of the group's call; truncated turns resume like responses
  (`asyncrl.rollouter.resumable`) but are never checkpointed (a resume regenerates the conversation).
- `generate_group` only generates; the send is separate, so the ``async_rollout`` skip role
  (`asyncrl.skip`) can answer a sample from a dump and the group is still sent as usual. The
  group filter (`asyncrl.rollouter.filters`) judges a complete group after that, replayed or not.
  The process that runs the Rollouter calls `SkipManager.init` (the registry is per process).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import numpy as np

from asyncrl.heap import settle_gc
from asyncrl.rollouter.admission import Admission, LockstepRounds, StalenessGate
from asyncrl.rollouter.config import RolloutConfig
from asyncrl.rollouter.agents import Agent, first_of_episodes, flatten_runs, run_agent_response
from asyncrl.rollouter.feed import Feed, Prompt, RolloutState, encode_prompts
from asyncrl.rollouter.filters import GroupFilter, GroupFilterStalled
from asyncrl.rollouter.partial import PartialBuffer, PartialResponse, PartialRolloutConfig
from asyncrl.rollouter.pool import EnginePool, GroupCalls
from asyncrl.rollouter.resumable import Rounds, generate_resumable
from asyncrl.rollouter.response import Ended, Response, ResponseOutcome, settle
from asyncrl.rollouter.rewards import Rewards
from asyncrl.rollouter.stats import RolloutStats
from asyncrl.skip import SkipManager, is_replayed
from asyncrl.types import EPISODES_KEY, FILTERED_KEY, GenerateRequest, Group, SamplingParams, parse_sample_id
from asyncrl.usercode import USER_ERROR_KEY, UserCodeError, UserErrors

__all__ = ["Prompt", "RolloutConfig", "RolloutState", "RolloutStats", "Rollouter", "encode_prompts", "settle_gc"]

log = logging.getLogger("asyncrl.rollouter")


_ADMIT_BURST = 64
"""Groups the feed admits in one turn of the event loop before it lets other work run; with an
agent loop, conversations (each starts by rendering its prompt on the loop: ~0.6 ms, docs/scale.md)."""


class Rollouter:
    """Generates groups from ``prompts`` on ``engines`` and sends them on ``producer``.

    ``engines`` are EngineActor handles or in-process objects: an `EngineActor` (its
    ``generate_group``) or an engine (awaitable ``generate``, one call per request; `EnginePool`).
    ``reward_fn(prompt, response_ids) -> float`` (or an awaitable of one) gets the `Prompt` (its
    text and row meta) and the response's token ids; a synchronous one runs on the Rollouter's
    reward threads, off its event loop (`Rewards`).
    ``partial`` turns partial rollout on; with ``truncate_at="threshold"`` it needs ``aggregator``
    (an `AggregatorActor` handle or instance); with ``truncate_at="sync"`` the engines truncate
    at each weight sync themselves (the coordinator's ``clear_cache``) and the Rollouter does
    nothing of its own.
    """

    def __init__(self, cfg: RolloutConfig, engines: Sequence[Any], producer: Any, prompts: Sequence[Prompt],
                 reward_fn: Callable[[Prompt, np.ndarray], float | Awaitable[float]], *, state: RolloutState | None = None,
                 partial: PartialRolloutConfig | None = None, aggregator: Any = None, agent: Agent | None = None):
        self.agent = agent
        """The agent loop each response runs (`asyncrl.rollouter.agents.build_agent`); None: one plain request."""
        self.pool = EnginePool(engines, cfg.request_timeout_s, cfg.result_batch_s, rpc=cfg.engine_calls == "zmq")
        self.state = state or RolloutState()
        self.feed = Feed(prompts, self.state)
        self.partial = partial or PartialRolloutConfig()
        if self.partial.by_count and aggregator is None:
            raise ValueError("partial_rollout.truncate_at='threshold' needs an aggregator (AggregatorActor over the engines)")
        self.cfg = cfg
        self.producer = producer
        self.reward_fn = reward_fn
        self.aggregator = aggregator if self.partial.by_count else None
        self.admitted = self.sent = self.state.done
        self.failed = 0
        self.given_back: set[str] = set()
        """sample_ids that will never be trained (failed, filtered, or dropped by the Trainer)."""
        self.filter = GroupFilter(cfg.group_filter, cfg.max_filtered_in_a_row)
        self.partials = PartialBuffer()
        self.stats = RolloutStats()
        self.replayed = 0
        """Groups the ``async_rollout`` skip role answered from dumps (no engine request)."""
        self._gate = asyncio.Condition()
        self._groups: dict[str, asyncio.Task] = {}  # sample_id admitted and not yet sent -> its task
        self.rounds = Rounds(self.partials, self.stats, self.partial.max_age if self.aggregator is not None else 0,
                             {sid: {k: Response(sid, k, parts, status="truncated") for k, parts in responses.items()}
                              for sid, responses in self.state.partials.items()})
        """The version, the round's end and the truncated responses (`snapshot` saves them)."""
        self._stopping = False
        self._finished = 0
        """Groups this run generated or replayed (complete or failed), counted before their send."""
        self.admission: Admission = (
            StalenessGate(cfg.staleness_threshold, cfg.groups_per_sync,
                          lambda: self.admitted - len(self.given_back) - self.state.dropped)
            if self.aggregator is None else  # the RFC's synchronous workflow: rounds end by count
            LockstepRounds(self.aggregator, self.rounds, groups_per_sync=cfg.groups_per_sync,
                           group_size=self._group_size, threshold=self.partial.threshold or 0,
                           usable=lambda: self.state.done - self.state.dropped + self._finished - len(self.given_back)))
        """What bounds the admissions by mode (`asyncrl.rollouter.admission`)."""
        self.rewards = Rewards(reward_fn, cfg.reward_workers)
        self.user_errors = UserErrors(cfg.on_user_error)

    @property
    def version(self) -> int:  # the weight version the engines serve (`on_sync`)
        return self.rounds.version

    # ------------------------------------------------------------------ control

    async def on_pause(self) -> None:
        """A weight sync is about to pause the engines: stop the request clocks."""
        self.pool.on_pause()

    async def on_sync(self, version: int) -> None:
        """The engines now serve ``version``: restart the clocks, release truncated responses
        (highest age first), then open the staleness gate accordingly."""
        self.pool.on_resume()
        async with self._gate:
            if version > self.version:
                self.rounds.version = version
                await self.admission.on_version(version)
                self.partials.release(version)
            self._gate.notify_all()

    async def replace_engine(self, index: int, engine: Any) -> None:
        """Replica ``index`` was started again (it holds the current weights): requests go to it again."""
        await self.pool.replace_engine(index, engine)

    async def on_dropped(self, sample_ids: Iterable[str]) -> None:
        """The Trainer dropped these groups by policy: their budget goes back to the gate."""
        async with self._gate:
            before = len(self.given_back)
            self.given_back.update(sample_ids)
            if len(self.given_back) > before:
                await self.admission.on_given_back()
            self._gate.notify_all()

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Drain: admit nothing more, cancel in-flight groups, abort their requests on the engines.

        `run` returns once its tasks are gone. Groups already sent stay with the producer (unacked)."""
        async with self._gate:
            self._stopping = True
            self._gate.notify_all()
        for task in list(self._groups.values()):
            task.cancel()
        try:
            await self.pool.abort_all(timeout_s)
        finally:
            self.pool.close()  # (the aborts were the last calls; a later one would open a socket again)

    def snapshot(self) -> dict:
        """The feed state for a checkpoint (JSON-able): position, plus the ids admitted and not yet
        sent (``in_flight``) and sent but not acked (``unacked``, when the producer tells)."""
        unacked = getattr(self.producer, "unacked", None)
        return {
            **self.feed.position(),
            "in_flight": sorted(self._groups, key=lambda sample_id: parse_sample_id(sample_id)[1]),
            "unacked": [g.sample_id for g in unacked] if unacked is not None else [],
            "partials": {sid: {str(k): response.parts.to_json() for k, response in responses.items()}
                         for sid, responses in self.rounds.truncated.items() if responses},
        }

    def _admissible(self) -> bool:
        return (self.admission.admissible() and self.admitted - self.sent < self.cfg.max_concurrent
                and self.partials.undispatched == 0)  # released partials go before new prompts

    # ------------------------------------------------------------------ feed

    def _draw(self) -> tuple[str, Prompt]:
        return self.feed.draw()

    async def run(self, num_groups: int | None = None) -> None:
        """Feed prompts until ``num_groups`` more groups were admitted (forever when None), or `stop`."""
        self.rewards.open()
        stop_at = None if num_groups is None else self.admitted + num_groups
        async with self._gate:
            await self.admission.start()
        burst = 0
        weight = 1 if self.agent is None else self.cfg.n * self.agent.sessions  # what one admission starts
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
                        self._groups[sample_id] = tg.create_task(Rewards.owned(self._one_group(sample_id, prompt)))
                    self.stats.gate_blocked_s += time.monotonic() - t0
                    # A sync opens the gate for a whole step at once: start its groups a few at a time,
                    # one event-loop turn apart, so a pause or resume waits behind a few groups' start.
                    burst += weight
                    if burst >= _ADMIT_BURST:
                        burst = 0
                        await asyncio.sleep(0)
        except* (GroupFilterStalled, UserCodeError) as eg:  # the run stops, saying why
            raise eg.exceptions[0] from None
        finally:
            self.rewards.close()

    # ------------------------------------------------------------------ one prompt

    async def _one_group(self, sample_id: str, prompt: Prompt) -> None:
        group = None
        try:
            try:
                # Filtered here, not in generate_group: a group replayed from a dump is judged afresh.
                group = await self.generate_group(sample_id, prompt)
                group = self.filter.judge(group)
            except UserCodeError as e:  # stop: raises; drop: the group, marked
                group = self.user_errors.group(e, sample_id, prompt, group, self._group_size)
            self._finished += 1
            if FILTERED_KEY in group.meta or USER_ERROR_KEY in group.meta:  # never trained: its budget goes back now
                self.given_back.add(sample_id)  # with _finished, before any await: a round (re)opened counts neither
                async with self._gate:
                    self._gate.notify_all()
            else:  # kept: in lockstep, a complete group counts in the round
                await self.admission.on_kept(sample_id)
            t0 = time.monotonic()
            await self.producer.send(group)
            self.rounds.truncated.pop(sample_id, None)  # its parts are in the group now (or it failed)
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
            self.admission.forget(sample_id)

    @SkipManager.annotate(role="async_rollout")
    async def generate_group(self, sample_id: str, prompt: Prompt) -> Group:
        """The ``n`` scored responses to ``prompt`` as one group (failed if any response failed).

        Generation only, nothing is sent: the ``async_rollout`` skip role may answer it from a
        dump of this ``sample_id``'s feed index instead of the engines. A complete group is
        noted for the aggregator (partial rollout), split by the replica that finished each
        response; `_one_group` reports it there if the group filter keeps it.
        """
        _, index = parse_sample_id(sample_id)
        calls = GroupCalls(self.pool)  # the group's requests of a round: one call, to the group's replica
        try:
            outcomes = await asyncio.gather(
                *(self._one_response(sample_id, index, k, prompt, calls) for k in range(self.cfg.n)),
                return_exceptions=True,
            )
        finally:
            await calls.close()
        ended, episodes = flatten_runs(self.agent, outcomes)  # a run of a loop: one entry per session or branch
        outcomes = await settle(ended, lambda exc: UserCodeError.of(
            exc, f"the reward function ({getattr(self.reward_fn, '__qualname__', 'reward_fn')})", sample_id, prompt.text))
        user = next((o for o in outcomes if isinstance(o, UserCodeError)), None)
        if user is not None:  # the user's code, not a fault: on_user_error decides (_one_group)
            raise user
        errors = [f"{k}: {type(o).__name__}: {o}" for k, o in enumerate(outcomes) if isinstance(o, BaseException)]
        trajectories = [o.trajectory for o in outcomes if isinstance(o, ResponseOutcome)]
        meta = {"prompt": prompt.text, **prompt.meta, **({EPISODES_KEY: episodes} if episodes else {})}
        if errors:
            return Group(sample_id=sample_id, trajectories=trajectories, expected=self._group_size, status="failed",
                         error="; ".join(errors), meta=meta)
        group = Group(sample_id=sample_id, trajectories=trajectories, meta=meta,
                      expected=len(episodes) if episodes else self._group_size)  # branches: n or more
        if group.complete:  # an episode's branches count once
            self.admission.on_complete(sample_id, (o.replica for o in first_of_episodes(outcomes, episodes)))
        return group

    def _request(self, sample_id: str, index: int, k: int, prompt: Prompt, parts: PartialResponse,
                 budget: int) -> GenerateRequest:
        """Response ``k``'s request: prompt + what it generated so far, the budget left, its own seed."""
        cfg = self.cfg
        ids, _, _ = parts.joined()
        return GenerateRequest(
            request_id=f"{sample_id}/{k}" + (f"/{parts.age}" if parts.age else ""),
            prompt_ids=np.concatenate([prompt.prompt_ids, ids]) if len(ids) else prompt.prompt_ids,
            max_tokens=budget - len(ids),
            sampling=SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                    seed=self._seed(index, k) + 7919 * parts.age),
        )

    @property
    def _group_size(self) -> int:
        """Trajectories in a group: ``n``, times the sessions of each run of a multi-output agent loop."""
        return self.cfg.n * (self.agent.sessions if self.agent is not None else 1)

    def _seed(self, index: int, k: int) -> int:
        return self.cfg.seed + 1000 * index + k

    async def _one_response(self, sample_id: str, index: int, k: int, prompt: Prompt,
                            calls: GroupCalls) -> Ended | list[Ended]:
        """One response, resumed across truncations: `Ended`, with the replica that finished it and
        its reward under way (`Rewards.start`). With an agent loop, the loop's run instead
        (`asyncrl.rollouter.agents`): a list, one entry per session."""
        if self.agent is not None:
            return await run_agent_response(self.agent, sample_id, k, prompt, calls, self._seed(index, k),
                                            cfg=self.cfg, rounds=self.rounds, rewards=self.rewards)
        budget = prompt.max_tokens or self.cfg.max_tokens
        response = self.rounds.truncated.get(sample_id, {}).get(k)
        resuming = response is not None  # only a resume puts a record there before this call
        response = response or Response(sample_id, k)
        response.prompt_ids = prompt.prompt_ids
        result, replica = await generate_resumable(
            self.rounds, calls, lambda p: self._request(sample_id, index, k, prompt, p, budget), response, budget,
            resuming=resuming)
        self.rounds.truncated.get(sample_id, {}).pop(k, None)  # finished: a resume would generate it again
        response.reward = self.rewards.start(prompt, response.finish(result.finish_reason, replica))
        return response.ended()

    def stats_now(self) -> dict:
        """`RolloutStats` and the pool's counters as a dict (the idle span in progress included),
        with ``time_s`` (monotonic)."""
        pool = self.pool
        out = {k: getattr(self.stats, k) for k in self.stats.__dataclass_fields__}
        out.update(time_s=time.monotonic(), waiting_partials=len(self.partials), idle_s=pool.idle_s(),
                   filter_judged=self.filter.judged, filter_dropped=self.filter.dropped,
                   user_errors=self.user_errors.dropped,
                   timed_out=pool.timed_out, dead_engines=pool.dead_engines, engine_calls=pool.calls,
                   requests_spread=pool.spread())
        counts = getattr(self.agent.loop, "counts", None) if self.agent is not None else None
        if counts:  # an EnvLoop's totals (a user's own AgentLoop keeps none)
            out.update({f"agent_{k}": v for k, v in counts.items()})
        return out
