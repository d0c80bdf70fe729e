"""Partial rollout: the settings, and the buffer where truncated responses wait for the next round.

A *round* is the span between two weight syncs (the weight version). When a round ends early
(`asyncrl.rollouter.aggregator.AggregatorActor` signals every replica), every unfinished request
of that round that has generated tokens stops with what it generated so far (one still queued
for a KV slot has nothing to keep: it stays queued and runs in the freed slots). Such a
response keeps its tokens (``raw_response_ids``), their behaviour log-probs and per-token
versions in `PartialResponse`, its ``age`` grows by one, and it waits in the `PartialBuffer`
until the next round begins: resuming on the same weights would only churn. When the round
advances, the buffer releases its waiting responses highest age first, and the Rollouter
dispatches them before it admits any new prompt. A resumed request continues from prompt +
partial response with the remaining token budget; its new tokens carry the new version, so the
finished trajectory concatenates parts of several versions, each token with its own version
and behaviour log-prob (the Trainer's importance weights use them token by token).

When a round ends (``truncate_at``):

- ``threshold``, the RFC's synchronous workflow (``mode=sync``): a round admits prompts, up
  to ``rollout.max_concurrent`` in flight (more than the step's groups: the over-provisioned
  batch), and ends once the step has its complete groups; the rest is truncated and the
  engines idle while the Trainer trains. A step then waits for its fastest groups, not its
  longest response;
- ``sync`` (``mode=async``): at each weight sync, inside the engines. They pause with
  ``keep`` and drop the KV cache of what they keep (`asyncrl.sync.coordinator`'s
  ``clear_cache``): every in-flight response stops there with its tokens, log-probs and
  versions, and after the sync goes on first, from prompt + partial response re-read under the
  new weights, where plain async mode continues on a KV cache computed by the old ones. Nothing
  goes back to the Rollouter or waits, so this costs only the re-read prefixes; the staleness
  gate, not ``max_age``, bounds how many versions such a response spans.

In sync mode a response of age ``max_age`` is no longer truncated: it runs to its end.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np

from asyncrl.types import GenerateResult

TRUNCATE_AT = ("sync", "threshold")


@dataclass(kw_only=True)
class PartialRolloutConfig:
    """Long-tail truncation across every engine replica (partial rollout)."""

    enable: bool = False
    """Truncate each round's unfinished requests when the round ends (``truncate_at``); off:
    requests are paused and kept through each weight sync instead."""
    threshold: int | None = None
    """``truncate_at=threshold``: trajectories (of complete groups) a round counts at least before
    it ends; None: what the Trainer's step still lacks, ``groups_per_sync * n`` at most."""
    max_age: int = 4
    """``truncate_at=threshold``: truncations a response may survive; one of this age runs to its end."""
    truncate_at: str = "sync"
    """``sync``: at each weight sync, inside the engines (``mode=async``); ``threshold``: once
    the round has the step's groups, the RFC's workflow (``mode=sync`` sets it)."""

    @property
    def by_count(self) -> bool:
        """On, with rounds ended by the aggregator's count (the Rollouter's lockstep)."""
        return self.enable and self.truncate_at == "threshold"

    @property
    def at_sync(self) -> bool:
        """On, with rounds ended at each weight sync inside the engines (the coordinator's ``clear_cache``)."""
        return self.enable and self.truncate_at == "sync"

    def __post_init__(self) -> None:
        if self.truncate_at not in TRUNCATE_AT:
            raise ValueError(f"PartialRolloutConfig.truncate_at must be one of {TRUNCATE_AT}, got {self.truncate_at!r}")
        if self.threshold is not None and self.threshold < 1:
            raise ValueError(f"PartialRolloutConfig.threshold must be >= 1 (or None for the default), "
                             f"got {self.threshold}")
        if self.max_age < 0:
            raise ValueError(f"PartialRolloutConfig.max_age must be >= 0, got {self.max_age}")

    def resolved_threshold(self, groups_per_sync: int, n: int) -> int:
        """The threshold in trajectories, its default filled in."""
        return self.threshold if self.threshold is not None else groups_per_sync * n


@dataclass
class PartialResponse:
    """The parts one response has generated so far, across truncations."""

    raw_response_ids: list[np.ndarray] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    versions: list[np.ndarray] = field(default_factory=list)
    age: int = 0
    """Truncations survived."""

    def to_json(self) -> dict:
        """A JSON-able copy (for the checkpoint's ``rollouter_state``); `from_json` reads it back exactly."""
        ids, logprobs, versions = self.joined()
        return {"age": self.age, "response_ids": ids.tolist(), "logprobs": logprobs.tolist(),
                "versions": versions.tolist()}

    @classmethod
    def from_json(cls, data: dict) -> PartialResponse:
        parts = cls(age=int(data["age"]))
        if data["response_ids"]:
            parts.raw_response_ids.append(np.asarray(data["response_ids"], dtype=np.int64))
            parts.logprobs.append(np.asarray(data["logprobs"], dtype=np.float32))
            parts.versions.append(np.asarray(data["versions"], dtype=np.int64))
        return parts

    def add(self, result: GenerateResult) -> None:
        self.raw_response_ids.append(result.response_ids)
        self.logprobs.append(result.logprobs)
        self.versions.append(result.versions)

    @property
    def n_tokens(self) -> int:
        return sum(len(p) for p in self.raw_response_ids)

    def joined(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(response_ids, logprobs, versions)`` of every part, concatenated."""
        if not self.raw_response_ids:
            return np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64)
        return (np.concatenate(self.raw_response_ids).astype(np.int64, copy=False),
                np.concatenate(self.logprobs).astype(np.float32, copy=False),
                np.concatenate(self.versions).astype(np.int64, copy=False))


class PartialBuffer:
    """Truncated responses waiting for a later round; released highest age first.

    ``wait(key, age, round)`` parks a response truncated in ``round``; it returns once
    `release` opens a later round and every older waiter was released before it. The
    Rollouter counts responses released but not yet dispatched (``undispatched``) and admits
    no new prompt while there are any: the buffer is served first.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, asyncio.Future]] = []  # (-age, order, round, future)
        self._order = itertools.count()
        self.undispatched = 0
        """Responses released by `release` and not yet marked `dispatched`."""

    def __len__(self) -> int:
        return len(self._heap)

    def ages(self) -> list[int]:
        return sorted((-a for a, _, _, _ in self._heap), reverse=True)

    async def wait(self, age: int, round: int) -> None:
        """Park a response of ``age`` truncated in ``round`` until a later round releases it."""
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (-age, next(self._order), round, future))
        try:
            await future
        except asyncio.CancelledError:
            if not future.done() or future.cancelled():
                self._heap = [e for e in self._heap if e[3] is not future]
                heapq.heapify(self._heap)
            else:
                self.undispatched -= 1
            raise

    def release(self, version: int) -> int:
        """Round ``version`` began: release every response truncated in an earlier round,
        highest age first (then first truncated first). Returns how many were released."""
        keep, released = [], 0
        while self._heap:
            entry = heapq.heappop(self._heap)
            if entry[2] >= version:
                keep.append(entry)
                continue
            if not entry[3].done():
                entry[3].set_result(None)
                self.undispatched += 1
                released += 1
        for entry in keep:
            heapq.heappush(self._heap, entry)
        return released

    def dispatched(self) -> None:
        """A released response was handed to an engine."""
        self.undispatched -= 1
