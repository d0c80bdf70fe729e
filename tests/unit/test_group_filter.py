"""Dynamic sampling (``rollout.group_filter``) in-process: the filters and their config, the
budget a dropped group gives back at once, the cap on drops in a row, a user filter that fails,
the version-gap bound with 70% of groups dropped (real Rollouter, engine and Trainer), the
lockstep round counting kept groups only, and a replayed group judged like a generated one."""

from __future__ import annotations

import asyncio
import json
import textwrap

import numpy as np
import pytest
import torch

from asyncrl.queue.memory import MemorySink
from asyncrl.rollouter import filters
from asyncrl.rollouter.actor import EngineActor
from asyncrl.rollouter.aggregator import AggregatorActor
from asyncrl.rollouter.engines.builtin.engine import TorchEngine
from asyncrl.rollouter.filters import GroupFilter, GroupFilterStalled, GroupView
from asyncrl.rollouter.partial import PartialRolloutConfig
from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
from asyncrl.types import FILTERED_KEY, Group, Trajectory, parse_sample_id
from tests.unit.inprocess import NotifyingSyncer, QueueStream, train_steps

USER_FILTERS = '''
from asyncrl.types import parse_sample_id

def index(view):
    return parse_sample_id(view.sample_id)[1]

def keep_from_5(view):
    return index(view) >= 5

def drop_all(view):
    return False

def keep_3_in_10(view):  # drops 70%
    return index(view) % 10 in (2, 5, 8)

def keep_1_in_3(view):
    return index(view) % 3 == 0

def fails_on_1(view):
    if index(view) == 1:
        raise ValueError("no verdict for index 1")
    return True

def returns_none(view):
    pass

not_callable = 3
'''


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the engine runs in this process; the machine's cores are shared


@pytest.fixture
def user_filters(tmp_path, monkeypatch):
    """The module ``user_filters`` (the filters above), importable as a user's ``module:function``."""
    (tmp_path / "user_filters.py").write_text(textwrap.dedent(USER_FILTERS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_filters"


def make_prompts(k=4):
    return [Prompt(text=f"p{i}", prompt_ids=np.array([1, 4 + i, 5], dtype=np.int64)) for i in range(k)]


def odd_first_token(prompt, response_ids):
    return float(response_ids[0] % 2)


def group(rewards, lengths=None, finish="stop", sid="sample_0_3"):
    lengths = lengths or [2] * len(rewards)
    ts = [Trajectory(sample_id=sid, index=k, prompt_ids=np.array([1, 2]), response_ids=np.arange(n) + 3,
                     logprobs=np.zeros(n, np.float32), versions=np.zeros(n, np.int64), finish_reason=finish,
                     reward=r) for k, (r, n) in enumerate(zip(rewards, lengths))]
    return Group(sample_id=sid, trajectories=ts[::-1], expected=len(rewards), meta={"prompt": "p3"})


# ------------------------------------------------------------------------------ filters and config

def test_zero_std_keeps_only_groups_whose_rewards_differ_and_the_view_is_read_only():
    view = GroupView.of(group([1.0, 0.0, 1.0], lengths=[1, 2, 3]))
    assert view.rewards.tolist() == [1.0, 0.0, 1.0] and view.lengths.tolist() == [1, 2, 3]  # index order
    assert view.finish_reasons == ("stop",) * 3 and view.meta == {"prompt": "p3"} and view.sample_id == "sample_0_3"
    with pytest.raises(ValueError):
        view.rewards[0] = 5.0
    assert filters.zero_std(view) is True
    assert filters.zero_std(GroupView.of(group([1.0, 1.0, 1.0]))) is False
    assert filters.zero_std(GroupView.of(group([0.0, 0.0]))) is False
    zero_std = GroupFilter("zero_std", max_in_a_row=10)
    g = group([0.5, 0.5])
    dropped = zero_std.judge(g)
    assert dropped.meta == {"prompt": "p3", FILTERED_KEY: "zero_std"} and g.meta == {"prompt": "p3"}  # a new group
    kept = group([0.5, 0.0])
    assert zero_std.judge(kept) is kept and (zero_std.judged, zero_std.dropped) == (2, 1)
    # Only complete groups are judged: one with a response cut off (partial rollout) or a failed one goes on as it is.
    cut = group([1.0, 1.0], finish="truncated")
    assert zero_std.judge(cut) is cut and zero_std.judged == 2
    assert GroupFilter("none", max_in_a_row=1).judge(g) is g


def test_config_errors_name_the_field(user_filters):
    assert RolloutConfig().group_filter == "none" and RolloutConfig().max_filtered_in_a_row == 64
    with pytest.raises(ValueError, match="RolloutConfig.group_filter must be none, zero_std or module:function"):
        RolloutConfig(group_filter="zero-std")
    with pytest.raises(ValueError, match="RolloutConfig.max_filtered_in_a_row must be >= 1"):
        RolloutConfig(max_filtered_in_a_row=0)
    with pytest.raises(ValueError, match=r"rollout.group_filter='no_such_mod:f': module 'no_such_mod' does not import"):
        filters.load("no_such_mod:f")
    with pytest.raises(ValueError, match="rollout.group_filter='user_filters:not_callable': module 'user_filters' has "
                                         "no callable 'not_callable'"):
        filters.load(f"{user_filters}:not_callable")
    assert filters.load(f"{user_filters}:drop_all")(None) is False and filters.load("none") is None


def test_the_launcher_refuses_a_filter_that_does_not_import_before_ray_starts(capsys):
    from asyncrl.config import load_config
    from asyncrl.launch import EXIT_USAGE, main

    cfg, _ = load_config([], ["rollout.group_filter=zero_std", "rollout.max_filtered_in_a_row=5"])
    assert (cfg.rollout.group_filter, cfg.rollout.max_filtered_in_a_row) == ("zero_std", 5)
    assert main(["rollout.group_filter=no_such_mod:keep"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("asyncrl: error: rollout.group_filter='no_such_mod:keep': module 'no_such_mod' does not "
                                         "import")
    assert main(["rollout.group_filter=zero-std"]) == EXIT_USAGE
    assert "rollout.group_filter must be none, zero_std or module:function" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the Rollouter

async def test_a_dropped_group_gives_its_budget_back_at_once(model_path, user_filters):
    """On-policy (budget 2 at version 0, no sync ever): prompts 0-4 are dropped, so only their
    refunds let the gate admit 5 and 6, the two kept groups the step needs."""
    engine = TorchEngine(model_path, eos_token_ids=())
    producer = MemorySink()
    cfg = RolloutConfig(n=2, max_tokens=2, groups_per_sync=2, staleness_threshold=0.0, max_concurrent=2,
                        group_filter=f"{user_filters}:keep_from_5")
    r = Rollouter(cfg, [engine], producer, make_prompts(), odd_first_token)
    try:
        await asyncio.wait_for(r.run(num_groups=7), 60)
    finally:
        await engine.close()
    dropped = sorted(g.sample_id for g in producer.groups if FILTERED_KEY in g.meta)
    assert dropped == [f"sample_{i // 4}_{i}" for i in range(5)] and r.given_back == set(dropped)
    assert all(g.meta.get(FILTERED_KEY, "kept") == (f"{user_filters}:keep_from_5" if g.sample_id in dropped else "kept")
               and g.complete for g in producer.groups)
    assert r.failed == 0 and r.admitted == 7 and not r._admissible()  # the two kept groups fill the budget
    assert r.stats_now()["filter_dropped"] == 5 and r.stats_now()["filter_judged"] == 7


async def test_nothing_passing_the_filter_stops_the_run_with_an_error_naming_it(model_path, user_filters):
    engine = TorchEngine(model_path, eos_token_ids=())
    cfg = RolloutConfig(n=2, max_tokens=2, groups_per_sync=100, max_concurrent=2,
                        group_filter=f"{user_filters}:drop_all", max_filtered_in_a_row=3)
    r = Rollouter(cfg, [engine], MemorySink(), make_prompts(), odd_first_token)
    try:
        with pytest.raises(GroupFilterStalled, match=r"rollout.group_filter=user_filters:drop_all dropped 3 groups in "
                                                     r"a row \(rollout.max_filtered_in_a_row=3\)"):
            await asyncio.wait_for(r.run(), 60)  # forever, but for the filter
    finally:
        await engine.close()
    # The run's other groups were cancelled; one that finished in the same turn of the loop as the
    # third drop may have been judged before the error reached run() (seen: 4 of 4 in flight judged).
    assert 3 <= r.filter.dropped <= 3 + cfg.max_concurrent - 1 and not r._groups
    from asyncrl.faults import programming_error

    assert programming_error(GroupFilterStalled("x")) == "GroupFilterStalled"  # the launcher does not restart on it


async def test_a_filter_that_raises_or_returns_no_verdict_is_a_user_error(model_path, user_filters):
    """``rollout.on_user_error``: ``drop`` sends the group marked (never trained) and counts it; ``stop``
    ends the run with the error naming the filter and the prompt."""
    from asyncrl.rollouter.filters import GroupFilterError
    from asyncrl.usercode import USER_ERROR_KEY

    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        producer = MemorySink()
        cfg = RolloutConfig(n=2, max_tokens=2, groups_per_sync=100, group_filter=f"{user_filters}:fails_on_1",
                            on_user_error="drop")
        r = Rollouter(cfg, [engine], producer, make_prompts(), odd_first_token)
        await asyncio.wait_for(r.run(num_groups=3), 60)
        line = ("rollout.group_filter=user_filters:fails_on_1 raised ValueError: no verdict for index 1 "
                "(on prompt sample_0_1 'p1')")
        (dropped,) = [g for g in producer.groups if g.status == "failed"]
        assert dropped.sample_id == "sample_0_1" and dropped.meta[USER_ERROR_KEY] == dropped.error == line
        assert len(dropped.trajectories) == 2 and r.user_errors.dropped == 1 and r.given_back == {"sample_0_1"}
        assert len(producer.groups) == 3 and not any(FILTERED_KEY in g.meta for g in producer.groups)
        assert r.stats_now()["user_errors"] == 1

        cfg = RolloutConfig(n=2, max_tokens=2, groups_per_sync=100, group_filter=f"{user_filters}:returns_none")
        r = Rollouter(cfg, [engine], MemorySink(), make_prompts(), odd_first_token)
        with pytest.raises(GroupFilterError) as raised:
            await asyncio.wait_for(r.run(num_groups=3), 60)
        assert raised.value.line().startswith("rollout.group_filter=user_filters:returns_none returned None; it must "
                                              "return True (keep the group) or False (drop it) (on prompt sample_0_")
        assert r.producer.groups == [] and not r._groups
    finally:
        await engine.close()


# ------------------------------------------------------------------------------ with the Trainer

async def test_dropping_70_percent_keeps_full_batches_on_policy_and_audits_each_drop_once(model_path, user_filters,
                                                                                         tmp_path):
    """On-policy (staleness 0, a sync every step): with 7 groups in 10 dropped, every step still
    trains its G groups, every trained token has version gap 0 (a budget refunded twice would let
    the Rollouter run a version ahead), and samples.jsonl names each drop once, reason filtered."""
    from asyncrl.models.tiny import build_tokenizer
    from asyncrl.trainer.config import OptimConfig, TrainerConfig, WorkerConfig

    G, steps = 2, 4
    tok = build_tokenizer()
    tcfg = TrainerConfig(worker=WorkerConfig(model_path=str(model_path), pad_token_id=tok.pad_token_id,
                                             optim=OptimConfig(lr=1e-3)),
                         groups_per_batch=G, recv_timeout_s=60, samples_path=str(tmp_path / "samples.jsonl"))
    rcfg = RolloutConfig(n=2, max_tokens=4, groups_per_sync=tcfg.groups_per_sync, staleness_threshold=0.0,
                         group_filter=f"{user_filters}:keep_3_in_10")
    engine = TorchEngine(model_path, seed=0, eos_token_ids=())
    results, rollouter, trainer, stream = await train_steps(tcfg, rcfg, engine, make_prompts(8), odd_first_token, steps)
    trained = [sid for r in results for sid in r.sample_ids]
    assert sorted(parse_sample_id(s)[1] for s in trained) == [2, 5, 8, 12, 15, 18, 22, 25]
    assert all(len(r.sample_ids) == G and r.metrics["staleness_max"] == 0.0 for r in results)
    dropped = [(sid, why) for r in results for sid, why in r.dropped]
    assert len(dropped) >= 12 and {why for _, why in dropped} == {"filtered"}
    assert all(parse_sample_id(sid)[1] % 10 not in (2, 5, 8) for sid, _ in dropped)
    m = results[-1].metrics
    assert m["filter/dropped_groups"] == len(results[-1].dropped)
    assert m["filter/kept_ratio"] == G / (G + m["filter/dropped_groups"])
    assert m["filter/prompts_per_trained_group"] == (G + m["filter/dropped_groups"]) / G
    # Version gap 0 also means the gate never ran ahead: every admitted group not given back is trained.
    assert rollouter.admitted - len(rollouter.given_back) <= (trainer.version + 1) * G
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    ids = [rec["sample_id"] for rec in records]
    assert len(ids) == len(set(ids)) and set(ids) == set(trained) | {sid for sid, _ in dropped}
    assert {rec["sample_id"] for rec in records if rec["status"] == "dropped" and rec["reason"] == "filtered"} == \
        {sid for sid, _ in dropped}
    assert {sid for sid, why in stream.acks if why == "filtered"} == {sid for sid, _ in dropped}


async def test_a_crash_after_a_checkpoint_trains_or_drops_each_id_once_and_never_regenerates_a_durable_drop(
        model_path, user_filters, tmp_path):
    """In-process crash and resume with a third of the groups filtered: run 3 steps (checkpoint at
    step 2), drop everything, restore the Trainer and the Rollouter's feed from the checkpoint,
    run to step 6. samples.jsonl lists each id once, exactly the committed set; no drop that was
    durable at the crash is generated again; one that was not is generated and judged again."""
    from asyncrl.models.tiny import build_tokenizer
    from asyncrl.rollouter.feed import RolloutState
    from asyncrl.sync.inprocess import InProcessSyncer
    from asyncrl.trainer.config import OptimConfig, TrainerConfig, WorkerConfig
    from asyncrl.trainer.ranks import RankGroup
    from asyncrl.trainer.trainer import Trainer
    from asyncrl.types import CommittedSet

    G, prompts = 2, make_prompts(8)
    tok = build_tokenizer()
    tcfg = TrainerConfig(worker=WorkerConfig(model_path=str(model_path), pad_token_id=tok.pad_token_id,
                                             optim=OptimConfig(lr=1e-3)),
                         groups_per_batch=G, recv_timeout_s=60, checkpoint_dir=str(tmp_path / "ckpt"),
                         checkpoint_every=2, samples_path=str(tmp_path / "samples.jsonl"))
    rcfg = RolloutConfig(n=2, max_tokens=3, groups_per_sync=G, staleness_threshold=0.0,
                         group_filter=f"{user_filters}:keep_1_in_3")
    log = tmp_path / "samples.jsonl"

    async def run(until_step: int, finish: bool):
        """One life of the run; returns (the ids its Rollouter sent, the Rollouter)."""
        engine = TorchEngine(model_path, seed=0, eos_token_ids=())
        stream, ranks = QueueStream(), RankGroup.start_local(tcfg)
        trainer = Trainer(tcfg, ranks, stream, None)
        state = RolloutState()
        if await trainer.restore():
            state = RolloutState.resume(trainer.restored_rollouter_state, trainer.committed, trainer.dropped,
                                        rows=len(prompts))
        rollouter = Rollouter(rcfg, [engine], stream, prompts, odd_first_token, state=state)
        syncer = InProcessSyncer(ranks, [engine])
        if trainer.version:  # as the launcher does at a resume: the engine takes the restored weights
            syncer.version = trainer.version - 1
            await syncer.sync()
        trainer.syncer = NotifyingSyncer(syncer, rollouter)
        trainer.rollouter_state, trainer.on_dropped = rollouter.snapshot, rollouter.on_dropped
        await rollouter.on_sync(trainer.version)
        sent = []
        send = stream.send
        stream.send = lambda g: (sent.append(g.sample_id), send(g))[1]
        feed = asyncio.create_task(rollouter.run())
        try:
            while trainer.step < until_step:
                await asyncio.wait_for(trainer.train_step(), 120)
            if finish:
                await trainer.finish()
                rollouter.final = rollouter.snapshot()  # before the stop cancels the groups in flight
        finally:  # without finish: a crash, whatever step 3 did is lost
            feed.cancel()
            await asyncio.gather(feed, return_exceptions=True)
            await engine.close()
            ranks.close()
        return sent, rollouter

    await run(3, finish=False)
    durable = {json.loads(line)["sample_id"]: json.loads(line) for line in log.read_text().splitlines()}
    assert {r["step"] for r in durable.values() if r["status"] == "trained"} == {1, 2}
    sent, rollouter = await run(6, finish=True)
    assert rollouter.state.done == len(durable)  # the resumed gate counts the durable groups as done
    records = [json.loads(line) for line in log.read_text().splitlines()]
    ids = [r["sample_id"] for r in records]
    assert len(ids) == len(set(ids))
    committed = CommittedSet.from_json(json.loads(
        (tmp_path / "ckpt" / (tmp_path / "ckpt" / "latest").read_text().strip() / "trainer_state.json").read_text()
    )["committed"])
    assert committed == set(ids)
    assert sorted(r["step"] for r in records if r["status"] == "trained") == [s for s in range(1, 7) for _ in range(G)]
    assert all(parse_sample_id(r["sample_id"])[1] % 3 == 0 for r in records if r["status"] == "trained")
    dropped = {r["sample_id"] for r in records if r["status"] == "dropped"}
    assert dropped and {r["reason"] for r in records if r["status"] == "dropped"} == {"filtered"}
    assert not set(sent) & set(durable)  # nothing durable before the crash is generated again
    # Every feed index below the final position is trained, dropped with a reason, or still pending
    # (in the feed's snapshot at the end, taken while the run still had its groups in flight).
    snap = rollouter.final
    pending = {parse_sample_id(s)[1] for s in snap["in_flight"] + snap["unacked"]}
    assert set(range(snap["next_index"])) <= {parse_sample_id(s)[1] for s in ids} | pending


# ------------------------------------------------------------------------------ lockstep and skip

async def test_a_lockstep_round_ends_at_the_steps_kept_groups_not_at_any_complete_ones(model_path, user_filters,
                                                                                       until):
    """--mode sync with partial rollout: the aggregator counts only the groups the filter keeps, so
    a round does not end (and idle the engines until a sync that never comes) on dropped groups."""
    engines = [EngineActor(kind="torch", model_path=model_path, eos_token_ids=(), seed=0)]
    cfg = RolloutConfig(n=2, max_tokens=3, groups_per_sync=2, staleness_threshold=0.0, max_concurrent=4,
                        group_filter=f"{user_filters}:keep_1_in_3")
    partial = PartialRolloutConfig(enable=True, truncate_at="threshold")
    aggregator = AggregatorActor(engines, threshold=partial.resolved_threshold(2, 2))
    producer = MemorySink()
    r = Rollouter(cfg, engines, producer, make_prompts(8), odd_first_token, partial=partial, aggregator=aggregator)
    task = asyncio.create_task(r.run())
    try:
        await until(lambda: r.rounds.closed, what="round 0 ended")
        kept = [g.sample_id for g in producer.groups if FILTERED_KEY not in g.meta]
        assert len(kept) >= 2 and r.filter.dropped >= 2, (kept, r.filter.dropped)
        assert all(parse_sample_id(sid)[1] % 3 == 0 for sid in kept)
        assert aggregator.count == 2 * len(kept)  # n trajectories per kept group, none of the dropped
    finally:
        await r.stop()
        await task
        await engines[0].close()


async def test_a_replayed_group_is_judged_like_a_generated_one(model_path, tmp_path):
    """The ``async_rollout`` skip role dumps groups as generated: a replay under the same filter
    keeps the same groups, and one without a filter keeps them all (no filter's mark in a dump)."""
    from asyncrl.skip import SkipConfig, SkipManager, SkipRoleConfig, is_replayed

    async def run(group_filter):
        SkipManager.init(SkipConfig(experiment="t", async_rollout=SkipRoleConfig(
            enable=True, dump_dir=str(tmp_path), steps=list(range(6)))), shape={"model": str(model_path)})
        engine = TorchEngine(model_path, eos_token_ids=())
        producer = MemorySink()
        cfg = RolloutConfig(n=3, max_tokens=3, groups_per_sync=100, seed=7, group_filter=group_filter)
        try:
            r = Rollouter(cfg, [engine], producer, make_prompts(6), odd_first_token)
            await asyncio.wait_for(r.run(num_groups=6), 120)
            return ({g.sample_id for g in producer.groups if FILTERED_KEY not in g.meta},
                    sum(map(is_replayed, producer.groups)), engine.stats()["requests"])
        finally:
            await engine.close()

    try:
        kept, replayed, requests = await run("zero_std")
        assert replayed == 0 and requests == 6 * 3 and 0 < len(kept) < 6, kept  # the seeds give both kinds
        assert await run("zero_std") == (kept, 6, 0)
        assert (await run("none"))[0] == {f"sample_0_{i}" for i in range(6)}
    finally:
        SkipManager.init(SkipConfig())
