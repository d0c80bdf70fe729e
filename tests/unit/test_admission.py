"""Admission's two kinds on their own (`asyncrl.rollouter.admission`): the staleness gate's budget
at given versions, and the lockstep rounds against a real `AggregatorActor` over simulated engine
replicas (a round opened with what the step lacks, reports per replica, the round's end, a round
reopened when groups are given back, a new round at each version). The Rollouter picks the kind
from whether it has an aggregator."""

from __future__ import annotations

import asyncio

import numpy as np

from asyncrl.queue.memory import MemorySink
from asyncrl.rollouter.actor import EngineActor
from asyncrl.rollouter.admission import LockstepRounds, StalenessGate
from asyncrl.rollouter.aggregator import AggregatorActor
from asyncrl.rollouter.partial import PartialBuffer, PartialRolloutConfig
from asyncrl.rollouter.resumable import Rounds
from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
from asyncrl.rollouter.stats import RolloutStats


def test_the_staleness_gate_admits_up_to_its_budget_at_each_version():
    outstanding = {"n": 0}
    gate = StalenessGate(1.0, 4, lambda: outstanding["n"])

    def admits(n: int) -> bool:
        outstanding["n"] = n
        return gate.admissible()

    assert gate.budget == 8 and admits(7) and not admits(8)  # version 0: (0 + 1 + 1) * 4
    asyncio.run(gate.on_version(2))
    assert gate.budget == 16 and admits(15) and not admits(16)
    # The lockstep's hooks change nothing here: only the count of groups not given back does.
    gate.on_complete("sample_0_0", iter([0, 1]))
    asyncio.run(gate.on_kept("sample_0_0"))
    gate.forget("sample_0_0")
    asyncio.run(gate.on_given_back())
    assert not admits(16) and admits(12)
    on_policy = StalenessGate(0.0, 3, lambda: outstanding["n"])
    outstanding["n"] = 3  # on-policy: one step's groups per version
    assert on_policy.budget == 3 and not on_policy.admissible()
    outstanding["n"] = 2
    assert on_policy.admissible()


def test_lockstep_rounds_count_reports_per_replica_and_reopen_when_groups_come_back():
    async def main():
        engines = [EngineActor(kind="sim", seed=r) for r in range(2)]
        aggregator = AggregatorActor(engines, None, rpc=False)
        rounds = Rounds(PartialBuffer(), RolloutStats(), max_age=2)
        usable = {"n": 0}
        lock = LockstepRounds(aggregator, rounds, groups_per_sync=2, group_size=3, usable=lambda: usable["n"])

        await lock.on_given_back()  # no round opened yet: nothing to reopen
        assert aggregator.round_threshold is None and not lock.opened
        await lock.start()  # round 0 lacks 2 groups: 6 trajectories
        assert aggregator.round == 0 and aggregator.round_threshold == 6 and lock.admissible()
        usable["n"] = 1
        await lock.start()  # opened already: the round keeps its end
        assert aggregator.round_threshold == 6

        lock.on_complete("sample_0_0", iter([0, 1, 1]))
        assert lock.reports == {"sample_0_0": {0: 1, 1: 2}}
        await lock.on_kept("sample_0_0")
        assert aggregator.count == 3 and aggregator.per_replica == {0: 1, 1: 2} and lock.reports == {}
        assert lock.admissible() and not rounds.closed

        lock.on_complete("sample_1_1", iter([1, 1, 1]))
        lock.forget("sample_1_1")  # dropped by the group filter (or cancelled): never reported
        await lock.on_kept("sample_1_1")
        assert aggregator.count == 3

        lock.on_complete("sample_2_2", iter([0, 0, 0]))
        await lock.on_kept("sample_2_2")  # 6 of 6: the round ends, the replicas close it
        assert aggregator.count == 6 and aggregator.per_replica == {0: 4, 1: 2} and aggregator.signalled
        assert rounds.closed and not lock.admissible()
        assert [e._closed_round for e in engines] == [0, 0]

        usable["n"] = 1  # the Trainer dropped one of the two: the step lacks a group again
        await lock.on_given_back()
        assert aggregator.round_threshold == 6 + 3 and not aggregator.signalled
        assert not rounds.closed and lock.admissible() and [e._closed_round for e in engines] == [None, None]

        usable["n"] = 2  # nothing lacking: a given-back group moves nothing
        rounds.closed = True
        await lock.on_given_back()
        assert rounds.closed and aggregator.round_threshold == 9

        await lock.on_version(1)  # round 1 lacks (1 + 1) * 2 - 2 = 2 groups
        assert aggregator.round == 1 and aggregator.count == 0 and aggregator.round_threshold == 6
        assert lock.admissible()
        usable["n"] = 5
        await lock.on_version(2)  # surplus from round 1: a new round still counts one group
        assert aggregator.round == 2 and aggregator.round_threshold == 3

        floor = LockstepRounds(aggregator, rounds, groups_per_sync=2, group_size=3, usable=lambda: 8, threshold=10)
        await floor.on_version(3)  # 3 lacking trajectories, but partial.threshold counts at least 10
        assert aggregator.round == 3 and aggregator.round_threshold == 10

    asyncio.run(main())


def test_the_rollouter_picks_lockstep_rounds_only_with_an_aggregator():
    engines = [EngineActor(kind="sim", seed=0)]
    prompts = [Prompt(text="p", prompt_ids=np.array([1, 4, 5], dtype=np.int64))]
    cfg = RolloutConfig(n=3, groups_per_sync=2, staleness_threshold=0.0)
    plain = Rollouter(cfg, engines, MemorySink(), prompts, lambda prompt, ids: 0.0)
    assert isinstance(plain.admission, StalenessGate) and plain.admission.budget == 2
    partial = PartialRolloutConfig(enable=True, truncate_at="threshold", threshold=4)
    lockstep = Rollouter(cfg, engines, MemorySink(), prompts, lambda prompt, ids: 0.0, partial=partial,
                         aggregator=AggregatorActor(engines, None, rpc=False))
    assert isinstance(lockstep.admission, LockstepRounds)
    admission = lockstep.admission
    assert (admission.group_size, admission.threshold, admission.rounds) == (3, 4, lockstep.rounds)
