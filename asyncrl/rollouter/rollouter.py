"""The Rollouter: feed prompts, generate ``n`` responses each on the engines, reward, send groups.

One asyncio loop, one task group::

    feed loop ─► staleness gate ─► one task per prompt ─► n requests, each to the least-loaded
    engine ─► reward each response ─► Group ─► StreamProducer.send (awaits credit)

- ``sample_id`` is ``sample_{epoch}_{index}``; ``index`` is the feed order at admission, and
  it continues across epochs and across a resume (`RolloutState.next_index`).
- Resume: a checkpoint stores the feed position; the ids admitted before it but not yet
  trained (in flight, or sent and not acked) are the feed indices below ``next_index`` that
  the Trainer's committed set lacks. A resumed Rollouter regenerates them by id
  (`RolloutState.pending`, served first, same ``sample_id`` and sampling seeds) before new
  ids continue from ``next_index``; ``admitted`` continues from the groups already done.
- `stop` drains: no new admissions, in-flight groups are cancelled and their requests aborted
  on the engines (a resume regenerates them), and `run` returns.
- Staleness gate (verl's fully-async knobs): after ``version`` weight syncs the Trainer will
  have consumed ``version * groups_per_sync`` groups; the Rollouter admits a new prompt only
  while ``admitted < (version + 1 + staleness_threshold) * groups_per_sync`` and fewer than
  ``max_concurrent`` prompts are in flight. ``staleness_threshold=0`` with one step per sync
  is on-policy. The Rollouter learns the version through `on_sync`, called by whoever runs
  the weight sync (the launcher wraps the coordinator).
- A response that fails (engine error) fails its whole group, which is still sent, with
  ``status="failed"`` and the error: the Trainer fails closed on it (or drops and counts it).
  An engine actor that died is left out from then on and its requests go again, same seed, to
  a live one; only when every engine died do responses fail.
- `generate_group` only generates; the send is separate, so the ``async_rollout`` skip role
  (`asyncrl.skip`) can answer a sample from a dump and the group is still sent as usual.
  The process that runs the Rollouter calls `SkipManager.init` (the registry is per process).

Left out here (later issues): the aggregator's long-tail truncation and the partial buffer.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
    """Response budget per request."""
    temperature: float = 1.0
    """Sampling temperature (behaviour logprobs are taken after it)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 disables it."""
    top_k: int = 0
    """Top-k sampling; 0 disables it."""
    groups_per_sync: int = 8
    """Groups the Trainer consumes between two weight syncs (groups per step x steps per sync)."""
    staleness_threshold: float = 0.0
    """Extra fraction of ``groups_per_sync`` that may be generated ahead of the next sync."""
    max_concurrent: int = 16
    """Prompts in flight at once across all engines."""
    request_timeout_s: float = 600.0
    """Deadline of one generate call; a response past it fails its group."""
    seed: int = 0
    """Base seed; request ``k`` of sample ``i`` samples with ``seed + 1000 * i + k``."""

    def __post_init__(self) -> None:
        for name in ("n", "max_tokens", "groups_per_sync", "max_concurrent"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.staleness_threshold < 0:
            raise ValueError(f"RolloutConfig.staleness_threshold must be >= 0, got {self.staleness_threshold}")


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
    """Of ``done``, how many were dropped: like failed groups they use none of the budget."""

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
        return st


@dataclass
class Prompt:
    """One dataset row, encoded."""

    text: str
    prompt_ids: np.ndarray
    meta: dict = field(default_factory=dict)


class Rollouter:
    """Generates groups from ``prompts`` on ``engines`` and sends them on ``producer``.

    ``engines`` are EngineActor handles (``.generate.remote``) or in-process engines
    (awaitable ``generate``); ``reward_fn(prompt, response_ids) -> float`` (or an awaitable of
    one) gets the `Prompt` (its text and row meta) and the response's token ids.
    """

    def __init__(self, cfg: RolloutConfig, engines: Sequence[Any], producer: Any, prompts: Sequence[Prompt],
                 reward_fn: Callable[[Prompt, np.ndarray], float | Awaitable[float]], *, state: RolloutState | None = None):
        if not engines:
            raise ValueError("Rollouter needs at least one engine")
        if not prompts:
            raise ValueError("Rollouter needs a non-empty dataset")
        self.cfg = cfg
        self.engines = list(engines)
        self.producer = producer
        self.prompts = list(prompts)
        self.reward_fn = reward_fn
        self.state = state or RolloutState()
        self.version = 0
        self.admitted = self.sent = self.state.done
        self.failed = self.state.dropped
        self._in_flight: dict[str, asyncio.Task] = {}  # sample_id admitted and not yet sent -> its task
        self._requests: dict[str, int] = {}  # request_id in flight -> engine index
        self._dead: dict[int, str] = {}  # engine index -> why it is no longer used
        self._stopping = False
        self.replayed = 0
        """Groups the ``async_rollout`` skip role answered from dumps (no engine request)."""
        self._load = [0] * len(self.engines)
        self._gate = asyncio.Condition()
        self._where(self.state.next_index)  # the state must fit the dataset
        for index in self.state.pending:
            if not 0 <= index < self.state.next_index:
                raise ValueError(f"RolloutState.pending holds {index}, not below next_index={self.state.next_index}")
            self._where(index)

    # ------------------------------------------------------------------ control

    async def on_sync(self, version: int) -> None:
        """The engines now serve ``version``: open the staleness gate accordingly."""
        async with self._gate:
            self.version = version
            self._gate.notify_all()

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Drain: admit nothing more, cancel in-flight groups, abort their requests on the engines.

        `run` returns once its tasks are gone. Groups already sent stay with the producer (unacked)."""
        async with self._gate:
            self._stopping = True
            self._gate.notify_all()
        for task in list(self._in_flight.values()):
            task.cancel()
        by_engine: dict[int, list[str]] = {}
        for request_id, e in self._requests.items():
            by_engine.setdefault(e, []).append(request_id)
        aborts = [_abort(self.engines[e], ids) for e, ids in by_engine.items()]
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
            "in_flight": sorted(self._in_flight, key=_index_of),
            "unacked": [g.sample_id for g in unacked] if unacked is not None else [],
        }

    def _admissible(self) -> bool:
        budget = (self.version + 1 + self.cfg.staleness_threshold) * self.cfg.groups_per_sync
        # Failed groups are never trained on, so they do not use up the Trainer's budget.
        return self.admitted - self.failed < budget and self.admitted - self.sent < self.cfg.max_concurrent

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
        """Feed prompts until ``num_groups`` groups were sent in all (forever when None), or `stop`."""
        async with asyncio.TaskGroup() as tg:
            while num_groups is None or self.admitted < num_groups:
                async with self._gate:
                    await self._gate.wait_for(lambda: self._stopping or self._admissible())
                    if self._stopping:
                        break
                    # Draw only once admitted: every index below next_index was admitted.
                    sample_id, prompt = self._draw()
                    self.admitted += 1
                    self._in_flight[sample_id] = tg.create_task(self._one_group(sample_id, prompt))

    # ------------------------------------------------------------------ one prompt

    async def _one_group(self, sample_id: str, prompt: Prompt) -> None:
        try:
            group = await self.generate_group(sample_id, prompt)
            await self.producer.send(group)
            async with self._gate:
                self.sent += 1
                self.failed += group.status == "failed"
                self.replayed += is_replayed(group)
                self._gate.notify_all()
        finally:
            self._in_flight.pop(sample_id, None)  # sent, or cancelled by stop()

    @SkipManager.annotate(role="async_rollout")
    async def generate_group(self, sample_id: str, prompt: Prompt) -> Group:
        """The ``n`` scored responses to ``prompt`` as one group (failed if any response failed).

        Generation only, nothing is sent: the ``async_rollout`` skip role may answer it from a
        dump of this ``sample_id``'s feed index instead of the engines.
        """
        _, index = parse_sample_id(sample_id)
        outcomes = await asyncio.gather(
            *(self._one_response(sample_id, index, k, prompt) for k in range(self.cfg.n)),
            return_exceptions=True,
        )
        errors = [f"{k}: {type(o).__name__}: {o}" for k, o in enumerate(outcomes) if isinstance(o, BaseException)]
        trajectories = [o for o in outcomes if isinstance(o, Trajectory)]
        meta = {"prompt": prompt.text, **prompt.meta}
        if errors:
            return Group(sample_id=sample_id, trajectories=trajectories, expected=self.cfg.n, status="failed",
                         error="; ".join(errors), meta=meta)
        return Group(sample_id=sample_id, trajectories=trajectories, expected=self.cfg.n, meta=meta)

    async def _one_response(self, sample_id: str, index: int, k: int, prompt: Prompt) -> Trajectory:
        cfg = self.cfg
        request = GenerateRequest(
            request_id=f"{sample_id}/{k}",
            prompt_ids=prompt.prompt_ids,
            max_tokens=cfg.max_tokens,
            sampling=SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                    seed=cfg.seed + 1000 * index + k),
        )
        while True:
            live = [i for i in range(len(self.engines)) if i not in self._dead]
            if not live:
                raise RuntimeError(f"{request.request_id}: every engine died ({'; '.join(self._dead.values())})")
            e = min(live, key=self._load.__getitem__)
            self._load[e] += 1
            self._requests[request.request_id] = e
            try:
                result: GenerateResult = await asyncio.wait_for(_call(self.engines[e], request), cfg.request_timeout_s)
                break
            except TimeoutError:
                raise TimeoutError(f"{request.request_id}: no result within request_timeout_s={cfg.request_timeout_s}")
            except Exception as exc:
                if not _actor_died(exc):
                    raise
                # Same request, same seed, on a live engine: the dead one's partial tokens are simply redone.
                if e not in self._dead:
                    self._dead[e] = f"engine {e}: {type(exc).__name__}"
                    log.warning("engine %d died (%s); its requests go to the %d live engines", e,
                                type(exc).__name__, len(self.engines) - len(self._dead))
            finally:
                self._load[e] -= 1
                del self._requests[request.request_id]
        reward = self.reward_fn(prompt, result.response_ids)
        if inspect.isawaitable(reward):
            reward = await reward
        return Trajectory(
            sample_id=sample_id, index=k, prompt_ids=prompt.prompt_ids, response_ids=result.response_ids,
            logprobs=result.logprobs, versions=result.versions, finish_reason=result.finish_reason,
            reward=float(reward),
        )


async def _call(engine: Any, request: GenerateRequest) -> GenerateResult:
    remote = getattr(engine.generate, "remote", None)
    if remote is not None:
        return await remote(request)
    return await engine.generate(request)


async def _abort(engine: Any, request_ids: list[str]) -> None:
    remote = getattr(engine.abort, "remote", None)
    await (remote(request_ids) if remote is not None else engine.abort(request_ids))


def _actor_died(exc: BaseException) -> bool:
    # Ray's RayActorError family (ActorDiedError, ActorUnavailableError), without importing ray.
    return any(c.__name__ == "RayActorError" for c in type(exc).__mro__)


def _index_of(sample_id: str) -> int:
    return parse_sample_id(sample_id)[1]


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
