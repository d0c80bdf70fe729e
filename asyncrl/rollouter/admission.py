"""Admission: what bounds the prompts the Rollouter admits, by mode. One interface, two kinds.

- `StalenessGate` (async mode, verl's fully-async knobs): after ``version`` weight syncs the
  Trainer will have consumed ``version * groups_per_sync`` groups; a prompt is admitted only while
  the groups admitted and not given back stay under ``(version + 1 + staleness_threshold) *
  groups_per_sync``. ``staleness_threshold=0`` with one step per sync is on-policy.
- `LockstepRounds` (sync mode with partial rollout, the RFC's workflow): no count bounds the
  admissions; a round admits until the `AggregatorActor` has counted the complete groups the
  Trainer's step still lacks, then nothing until the next sync. Each kept group is reported there,
  split by the replica that finished each trajectory.

Both read narrow inputs (callables over the Rollouter's counts, the `Rounds` record), never the
Rollouter; the Rollouter adds what bounds both alike (``max_concurrent``, released partials first)
and calls only this interface, ``admissible``, ``start``, ``on_version`` and ``on_given_back`` under
its gate's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from asyncrl.calls import call
from asyncrl.rollouter.resumable import Rounds


class Admission(Protocol):
    """What the Rollouter asks and tells about admission."""

    def admissible(self) -> bool:
        """The mode's own bound lets one more prompt in."""

    async def start(self) -> None:
        """`Rollouter.run` begins (a no-op when a sync has already set things up)."""

    async def on_version(self, version: int) -> None:
        """The engines now serve a newer ``version``."""

    async def on_given_back(self) -> None:
        """The Trainer dropped groups by policy (``given_back`` grew): the step lacks them now."""

    def on_complete(self, sample_id: str, replicas: Iterable[int]) -> None:
        """A complete group was generated; ``replicas``: the replica that finished each trajectory
        that counts (an episode's branches once), a generator only the lockstep consumes."""

    async def on_kept(self, sample_id: str) -> None:
        """The group filter kept the group (it will be sent); called before its send, without the lock."""

    def forget(self, sample_id: str) -> None:
        """The group is sent, dropped or cancelled: nothing of it is kept any longer."""


class StalenessGate:
    """Async mode: at most ``(version + 1 + staleness_threshold) * groups_per_sync`` groups admitted
    and not given back. ``outstanding()``: admitted less given back (failed, filtered, dropped by
    the Trainer, dropped before a resume)."""

    def __init__(self, staleness_threshold: float, groups_per_sync: int, outstanding: Callable[[], int]):
        self.staleness_threshold = staleness_threshold
        self.groups_per_sync = groups_per_sync
        self.outstanding = outstanding
        self.version = 0

    @property
    def budget(self) -> float:
        """Groups that may be admitted and not given back at the current version."""
        return (self.version + 1 + self.staleness_threshold) * self.groups_per_sync

    def admissible(self) -> bool:
        return self.outstanding() < self.budget

    async def start(self) -> None:
        pass

    async def on_version(self, version: int) -> None:
        self.version = version  # the budget grows by groups_per_sync per version

    async def on_given_back(self) -> None:
        pass  # outstanding() counts it already

    def on_complete(self, sample_id: str, replicas: Iterable[int]) -> None:
        pass

    async def on_kept(self, sample_id: str) -> None:
        pass

    def forget(self, sample_id: str) -> None:
        pass


class LockstepRounds:
    """Sync mode: a round per weight version that the ``aggregator`` (an `AggregatorActor` handle or
    instance) ends once it counts the trajectories of the complete groups the step still lacks.

    ``rounds``: where the round's end is written (`Rounds.closed`, read by the resumable
    generations too). ``usable()``: groups that will be or were trained so far (done before a
    resume and finished in this run, less those given back). ``group_size``: the trajectories of a
    group; ``threshold``: partial rollout's own least count per round (0: none).
    """

    def __init__(self, aggregator: Any, rounds: Rounds, *, groups_per_sync: int, group_size: int,
                 usable: Callable[[], int], threshold: int = 0):
        self.aggregator = aggregator
        self.rounds = rounds
        self.groups_per_sync = groups_per_sync
        self.group_size = group_size
        self.usable = usable
        self.threshold = threshold
        self.version = 0
        self.opened = False
        """A round was opened (by `start` or a sync): only then does a given-back group reopen it."""
        self.reports: dict[str, dict[int, int]] = {}
        """A complete group's trajectories per replica, until it is kept (reported) or forgotten."""

    def admissible(self) -> bool:
        return not self.rounds.closed  # the round, not a count, bounds what is admitted

    async def start(self) -> None:
        if not self.opened:
            await self._open()

    async def on_version(self, version: int) -> None:
        self.version = version
        await self._open()

    async def on_given_back(self) -> None:
        if self.opened:
            await self._open(at_least_one=False)  # the step lacks them now: the round goes on

    async def _open(self, at_least_one: bool = True) -> None:
        """(Re)open the round of ``version``: it ends once it counts the complete groups the
        Trainer's step still lacks (and ``threshold`` trajectories, when set)."""
        lacking = (self.version + 1) * self.groups_per_sync - self.usable()
        if lacking <= 0 and not at_least_one:
            return
        # A new round counts at least one group, so what resumes in it makes progress before
        # the next truncation (surplus groups from a race at the last round's end go first).
        need = max(lacking, 1) * self.group_size
        await call(self.aggregator, "start_round", self.version, max(need, self.threshold))
        self.rounds.closed, self.opened = False, True

    def on_complete(self, sample_id: str, replicas: Iterable[int]) -> None:
        per_replica: dict[int, int] = {}
        for replica in replicas:
            per_replica[replica] = per_replica.get(replica, 0) + 1
        self.reports[sample_id] = per_replica

    async def on_kept(self, sample_id: str) -> None:
        per_replica = self.reports.pop(sample_id, None)
        if per_replica is None:  # failed, or not complete: it counts in no round
            return
        version = self.version
        if await call(self.aggregator, "report", version, per_replica) and version == self.version:
            self.rounds.closed = True  # the step has its groups: admit nothing until the sync

    def forget(self, sample_id: str) -> None:
        self.reports.pop(sample_id, None)
