"""The Rollouter: feed prompts, generate ``n`` responses each on the engines, reward, send groups.

One asyncio loop, one task group::

    feed loop ─► staleness gate ─► one task per prompt ─► n requests, each to the least-loaded
    engine ─► reward each response ─► Group ─► StreamProducer.send (awaits credit)

- ``sample_id`` is ``sample_{epoch}_{index}``; ``index`` is the feed order at enqueue time, and
  it continues across epochs and across a resume (`RolloutState.next_index`).
- Staleness gate (verl's fully-async knobs): after ``version`` weight syncs the Trainer will
  have consumed ``version * groups_per_sync`` groups; the Rollouter admits a new prompt only
  while ``admitted < (version + 1 + staleness_threshold) * groups_per_sync`` and fewer than
  ``max_concurrent`` prompts are in flight. ``staleness_threshold=0`` with one step per sync
  is on-policy. The Rollouter learns the version through `on_sync`, called by whoever runs
  the weight sync (the launcher wraps the coordinator).
- A response that fails (engine error) fails its whole group, which is still sent, with
  ``status="failed"`` and the error: the Trainer fails closed on it (or drops and counts it).
- `generate_group` only generates; the send is separate, so the ``async_rollout`` skip role
  (`asyncrl.skip`) can answer a sample from a dump and the group is still sent as usual.
  The process that runs the Rollouter calls `SkipManager.init` (the registry is per process).

Left out here (later issues): the aggregator's long-tail truncation and the partial buffer.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.skip import SkipManager, is_replayed
from asyncrl.types import GenerateRequest, GenerateResult, Group, SamplingParams, Trajectory, make_sample_id, parse_sample_id

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
    """What the Rollouter checkpoints: where the feed stands."""

    epoch: int = 0
    next_index: int = 0
    """Feed index of the next prompt (never restarts)."""
    position: int = 0
    """Row of the current epoch to feed next."""


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
        self.admitted = 0
        self.sent = 0
        self.failed = 0
        self.replayed = 0
        """Groups the ``async_rollout`` skip role answered from dumps (no engine request)."""
        self._load = [0] * len(self.engines)
        self._gate = asyncio.Condition()

    # ------------------------------------------------------------------ control

    async def on_sync(self, version: int) -> None:
        """The engines now serve ``version``: open the staleness gate accordingly."""
        async with self._gate:
            self.version = version
            self._gate.notify_all()

    def _admissible(self) -> bool:
        budget = (self.version + 1 + self.cfg.staleness_threshold) * self.cfg.groups_per_sync
        # Failed groups are never trained on, so they do not use up the Trainer's budget.
        return self.admitted - self.failed < budget and self.admitted - self.sent < self.cfg.max_concurrent

    # ------------------------------------------------------------------ feed

    def _feed(self) -> Iterator[tuple[str, Prompt]]:
        while True:
            while self.state.position < len(self.prompts):
                prompt = self.prompts[self.state.position]
                sample_id = make_sample_id(self.state.epoch, self.state.next_index)
                self.state.position += 1
                self.state.next_index += 1
                yield sample_id, prompt
            self.state.epoch += 1
            self.state.position = 0

    async def run(self, num_groups: int | None = None) -> None:
        """Feed prompts until ``num_groups`` groups were sent (forever when None)."""
        feed = self._feed()
        async with asyncio.TaskGroup() as tg:
            # Check the limit before drawing: a drawn prompt advances the feed index for good.
            while num_groups is None or self.admitted < num_groups:
                sample_id, prompt = next(feed)
                async with self._gate:
                    await self._gate.wait_for(self._admissible)
                    self.admitted += 1
                tg.create_task(self._one_group(sample_id, prompt))

    # ------------------------------------------------------------------ one prompt

    async def _one_group(self, sample_id: str, prompt: Prompt) -> None:
        group = await self.generate_group(sample_id, prompt)
        await self.producer.send(group)
        async with self._gate:
            self.sent += 1
            self.failed += group.status == "failed"
            self.replayed += is_replayed(group)
            self._gate.notify_all()

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
        e = min(range(len(self.engines)), key=self._load.__getitem__)
        self._load[e] += 1
        try:
            result: GenerateResult = await asyncio.wait_for(_call(self.engines[e], request), cfg.request_timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{request.request_id}: no result within request_timeout_s={cfg.request_timeout_s}")
        finally:
            self._load[e] -= 1
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
