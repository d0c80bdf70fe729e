"""Partial rollout in-process, both ways a round ends: by count in the RFC's synchronous
workflow (a round keeps more prompts in flight than the step needs and ends once the step has
its complete groups; no prompt is admitted after that until the sync) and at the weight sync
in async mode (in the engines, which re-read the prefix under the new weights). Truncated
responses resume next round highest age first, ``max_age`` is honoured, and every token of a
resumed response keeps the version and the behaviour log-prob it was sampled with, across a
checkpoint too."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from asyncrl.models.tiny import build_tiny_model
from asyncrl.rollouter.actor import EngineActor
from asyncrl.rollouter.aggregator import AggregatorActor
from asyncrl.rollouter.partial import PartialBuffer, PartialResponse, PartialRolloutConfig
from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
from asyncrl.queue.memory import MemorySink
from asyncrl.types import GenerateRequest, SamplingParams

N, GROUPS_PER_SYNC, SHORT, LONG = 2, 2, 3, 48




@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def long_tail_prompts(k: int) -> list[Prompt]:
    # Every fourth prompt asks for a response 16x as long as the others (EOS is off, so the
    # engine generates exactly the budget unless it is truncated).
    return [Prompt(text=f"p{i}", prompt_ids=np.array([1, 4 + i % 20, 5], dtype=np.int64),
                   max_tokens=LONG if i % 4 == 0 else SHORT) for i in range(k)]


async def sync_engines(engines, version: int, snapshots: dict) -> None:
    """A weight sync in-process: perturb the weights, pause (dropping the KV so the recompute
    below is exact), load, make live, resume. Records each version's weights."""
    sd = {k: v.clone() for k, v in engines[0].engine.model.state_dict().items()}
    gen = torch.Generator().manual_seed(version)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in sd.items()}
    for e in engines:
        names = {n for n, _, _ in await e.param_meta()}
        await e.pause("keep", clear_cache=True)
        await e.load_weights([(k, v) for k, v in new.items() if k in names])
        await e.finish_weight_update(version)
        await e.resume()
    # What the engines really serve (tied weights load once, through their first name).
    snapshots[version] = {k: v.clone() for k, v in engines[0].engine.model.state_dict().items()}


async def run_with_syncs(r: Rollouter, engines, producer, num_groups: int, snapshots: dict, at_pause=None):
    """Run the Rollouter; sync like a Trainer does: once ``groups_per_sync`` more complete groups arrived
    (``at_pause(r)``: called at each sync once the Rollouter paused, before the weights change)."""
    task = asyncio.create_task(r.run(num_groups=num_groups))
    version = 0
    async with asyncio.timeout(240):
        while not task.done():
            need = (version + 1) * GROUPS_PER_SYNC
            while not task.done() and sum(g.complete for g in producer.groups) < need:
                await asyncio.sleep(0.01)
            if task.done():
                break
            version += 1
            await r.on_pause()
            if at_pause is not None:
                at_pause(r)
            await sync_engines(engines, version, snapshots)
            await r.on_sync(version)
        await task
    return version


@torch.no_grad()
def worst_logprob_error(model_path, snapshots: dict, trajectories) -> tuple[float, int]:
    """Largest gap between a token's behaviour log-prob and a recompute under the weights of
    its own version, over every token of ``trajectories``; and how many tokens were checked."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    worst, checked = 0.0, 0
    for v in sorted({int(v) for t in trajectories for v in t.versions}):
        model.load_state_dict(snapshots[v], strict=False)
        for t in trajectories:
            positions = np.nonzero(t.versions == v)[0]
            if not len(positions):
                continue
            ids = torch.as_tensor(np.concatenate([t.prompt_ids, t.response_ids]))[None]
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            p = len(t.prompt_ids)
            ref = np.array([logp[p + i - 1, int(t.response_ids[i])].item() for i in positions])
            worst = max(worst, float(np.abs(ref - t.logprobs[positions]).max()))
            checked += len(positions)
    return worst, checked


def check_trajectories(producer, max_age: int) -> list:
    """Every sent group complete, every response at its own budget with versions that never go
    back; returns the resumed trajectories (age >= 1)."""
    assert all(g.complete for g in producer.groups)
    trajectories = [t for g in producer.groups for t in g.trajectories]
    for t in trajectories:
        assert t.finish_reason == "length"
        assert len(t.response_ids) == (LONG if int(t.sample_id.split("_")[-1]) % 4 == 0 else SHORT)
        assert t.reward == float(len(t.response_ids))
        assert np.all(np.diff(t.versions) >= 0)  # later parts carry later versions
        assert t.age <= max_age
    return [t for t in trajectories if t.age >= 1]


@pytest.mark.parametrize("max_age", [1, 3])
async def test_sync_workflow_ends_each_round_at_the_steps_groups_and_resumes_the_long_tail(model_path, max_age):
    engines = [EngineActor(kind="torch", model_path=model_path, eos_token_ids=(), seed=0) for _ in range(2)]
    snapshots = {0: {k: v.clone() for k, v in engines[0].engine.model.state_dict().items()}}
    # mode=sync: no run-ahead by count; a round keeps 4 prompts in flight for a step of 2.
    cfg = RolloutConfig(n=N, max_tokens=SHORT, groups_per_sync=GROUPS_PER_SYNC, staleness_threshold=0.0,
                        max_concurrent=4)
    partial = PartialRolloutConfig(enable=True, max_age=max_age, truncate_at="threshold")
    aggregator = AggregatorActor(engines, threshold=partial.resolved_threshold(GROUPS_PER_SYNC, N))
    producer = MemorySink()
    r = Rollouter(cfg, engines, producer, long_tail_prompts(40), lambda prompt, ids: float(len(ids)),
                  partial=partial, aggregator=aggregator)
    try:
        versions = await run_with_syncs(r, engines, producer, 12, snapshots)
    finally:
        for e in engines:
            await e.close()

    # Rounds ended by count, at the step's G * n = 4 trajectories of complete groups (the
    # Rollouter sets each round's), and the signal stopped requests that were still running.
    assert aggregator.truncated_rounds and sum(aggregator.truncated_rounds.values()) >= 1
    assert r.stats.truncated >= 1 and r.stats.resumed == r.stats.truncated
    # A sync for every step's groups but those the last round brought at once: a round ends at the
    # step's groups, but groups finishing in the same decode step are sent too, so the last round
    # may bring up to its 4 in flight, ending the run before the harness syncs for them.
    assert len(producer.groups) == 12 and versions >= (12 - cfg.max_concurrent) // GROUPS_PER_SYNC
    resumed = check_trajectories(producer, max_age)
    # Ages grow across rounds (a long response is stopped in several), never beyond max_age.
    assert resumed and min(2, max_age) <= max(t.age for t in resumed)
    assert all(len(set(t.versions.tolist())) >= 2 for t in resumed if len(t.response_ids) == LONG)
    # Behaviour log-probs: every token of every resumed response equals a recompute under its
    # own version's weights.
    worst, checked = worst_logprob_error(model_path, snapshots, resumed)
    assert checked >= sum(len(t.response_ids) for t in resumed) and worst <= 1e-4, worst


async def test_sync_workflow_admits_nothing_once_the_round_has_its_groups_until_the_sync(model_path, until):
    engines = [EngineActor(kind="torch", model_path=model_path, eos_token_ids=(), seed=0)]
    cfg = RolloutConfig(n=N, max_tokens=SHORT, groups_per_sync=GROUPS_PER_SYNC, staleness_threshold=0.0,
                        max_concurrent=4)
    partial = PartialRolloutConfig(enable=True, truncate_at="threshold")
    aggregator = AggregatorActor(engines, threshold=partial.resolved_threshold(GROUPS_PER_SYNC, N))
    producer = MemorySink()
    r = Rollouter(cfg, engines, producer, long_tail_prompts(40), lambda prompt, ids: float(len(ids)),
                  partial=partial, aggregator=aggregator)
    task = asyncio.create_task(r.run())
    try:
        # Round 0 keeps 4 prompts in flight (index 0 is long; a finished group's slot is refilled
        # while the round is open): once two groups are complete it ends, what runs is truncated
        # with its tokens (sample 0 among them), and nothing more is admitted.
        # (A short group may finish in the same decode step as the second: it is sent too.)
        await until(lambda: r.rounds.closed and len(r.partials) >= N and len(producer.groups) >= GROUPS_PER_SYNC,
                    what="round 0 ended, sample 0 truncated")
        admitted = r.admitted
        await asyncio.sleep(0.3)  # the engine idles now; a gate that admitted would have done it by then
        assert r.admitted == admitted <= 4 + len(producer.groups) and r.admitted - r.sent <= 4
        assert aggregator.truncated_rounds[0] >= N and aggregator.round_threshold == 2 * N
        assert "sample_0_0" in r.rounds.truncated
        assert all(len(g.trajectories[0].response_ids) == SHORT for g in producer.groups), [
            (g.sample_id, g.status, g.error, [len(t.response_ids) for t in g.trajectories]) for g in producer.groups]

        # The Trainer drops all sent groups but one by policy: the step lacks one, the round goes on.
        count = aggregator.count
        await r.on_dropped([g.sample_id for g in producer.groups[1:]])
        assert not r.rounds.closed and aggregator.round_threshold == count + N and not aggregator.signalled
        await until(lambda: r.admitted > admitted, what="a replacement admitted")

        # The sync: the truncated responses go first, then the new round admits again, and ends
        # at the step's groups: sample 0 (48 tokens) is stopped again, with tokens of both versions.
        await r.on_pause()
        await sync_engines(engines, 1, {})
        await r.on_sync(1)
        await until(lambda: r.rounds.closed and r.rounds.truncated.get("sample_0_0", {}).get(0, PartialResponse()).age == 2,
                    what="round 1 ended, sample 0 truncated again")
        assert r.stats.resumed >= N and aggregator.truncated_rounds[1] >= N
        for response in r.rounds.truncated["sample_0_0"].values():
            ids, _, versions = response.parts.joined()
            assert response.age == 2 and response.status == "truncated" and set(versions.tolist()) == {0, 1} and len(ids) < LONG
    finally:
        await r.stop()
        await task
        await engines[0].close()


async def test_async_mode_truncates_in_the_engines_at_each_sync_and_rereads_the_prefix(model_path):
    engines = [EngineActor(kind="torch", model_path=model_path, eos_token_ids=(), seed=0) for _ in range(2)]
    snapshots = {0: {k: v.clone() for k, v in engines[0].engine.model.state_dict().items()}}
    cfg = RolloutConfig(n=N, max_tokens=SHORT, groups_per_sync=GROUPS_PER_SYNC, staleness_threshold=1.0,
                        max_concurrent=8)
    producer = MemorySink()
    # truncate_at="sync", async mode's: no aggregator; the syncs below pause with keep and drop
    # the KV cache, as the launcher's coordinator does with partial rollout on in async mode.
    r = Rollouter(cfg, engines, producer, long_tail_prompts(40), lambda prompt, ids: float(len(ids)),
                  partial=PartialRolloutConfig(enable=True))
    try:
        await run_with_syncs(r, engines, producer, 12, snapshots)
        reread = sum([(await e.stats())["reprefill_tokens"] for e in engines])
    finally:
        for e in engines:
            await e.close()
    # Nothing went back to the Rollouter or waited: the engines stopped what ran at each sync
    # and went on with it after, from prompt + partial response re-read under the new weights.
    assert r.aggregator is None and r.stats.truncated == 0 and len(r.partials) == 0
    assert check_trajectories(producer, max_age=0) == [] and len(producer.groups) == 12
    spanning = [t for g in producer.groups for t in g.trajectories if len(set(t.versions.tolist())) > 1]
    assert spanning and reread >= sum(len(t.prompt_ids) + 1 for t in spanning)
    # So every token, before and after a sync, has the log-prob of its own version's weights
    # given the whole prefix (a kept KV cache of the old weights would not give that).
    worst, checked = worst_logprob_error(model_path, snapshots, spanning)
    assert checked == sum(len(t.response_ids) for t in spanning) and worst <= 1e-4, worst


async def test_truncation_stops_requests_with_tokens_and_leaves_queued_ones_to_run(model_path):
    # Two KV slots, four truncatable requests: two run, two wait for a slot.
    actor = EngineActor(kind="torch", model_path=model_path, eos_token_ids=(), seed=0, max_running=2)
    from asyncrl.types import GenerateRequest, SamplingParams

    try:
        requests = [GenerateRequest(f"r{i}", np.array([1, 4 + i, 5]), max_tokens=40,
                                    sampling=SamplingParams(temperature=1.0, seed=i)) for i in range(4)]
        tasks = [asyncio.create_task(actor.generate(r, True)) for r in requests]
        await asyncio.sleep(0)
        await actor.wait_for_tokens("r0", 3)
        await actor.wait_for_tokens("r1", 1)
        assert await actor.truncate(1) == 0  # a round the engine does not serve: ignored
        assert await actor.truncate(0) == 2
        results = await asyncio.gather(*tasks)
    finally:
        await actor.close()
    assert [r.finish_reason for r in results] == ["truncated", "truncated", "length", "length"]
    assert all(0 < len(r.response_ids) < 40 for r in results[:2])
    assert all(len(r.response_ids) == 40 for r in results[2:])  # they ran in the freed slots


async def test_partial_buffer_releases_highest_age_first_and_only_later_rounds():
    buf = PartialBuffer()
    order = []

    async def park(name, age, round_):
        await buf.wait(age, round_)
        order.append(name)
        buf.dispatched()

    tasks = [asyncio.create_task(park(name, age, rnd))
             for name, age, rnd in [("a1", 1, 0), ("c3", 3, 0), ("b2", 2, 0), ("late", 5, 1)]]
    await asyncio.sleep(0)
    assert len(buf) == 4
    assert buf.release(1) == 3  # round 1 began: what round 0 truncated goes, the oldest first
    await asyncio.gather(*tasks[:3])
    assert order == ["c3", "b2", "a1"] and buf.undispatched == 0 and len(buf) == 1
    buf.release(2)
    await tasks[3]
    assert order[-1] == "late"


def test_partial_config_errors_name_the_field():
    with pytest.raises(ValueError, match="threshold"):
        PartialRolloutConfig(threshold=0)
    with pytest.raises(ValueError, match="max_age"):
        PartialRolloutConfig(max_age=-1)
    assert PartialRolloutConfig().resolved_threshold(3, 8) == 24
    with pytest.raises(ValueError, match="truncate_at='threshold' needs an aggregator"):
        Rollouter(RolloutConfig(), [object()], MemorySink(), long_tail_prompts(1), lambda p, i: 0.0,
                  partial=PartialRolloutConfig(enable=True, truncate_at="threshold"))
    with pytest.raises(ValueError, match="truncate_at must be one of"):
        PartialRolloutConfig(truncate_at="end")


async def test_a_checkpoint_keeps_the_partial_buffer_and_a_resume_continues_each_response_from_its_parts(
        model_path, until):
    import json

    from asyncrl.rollouter.rollouter import RolloutState
    from asyncrl.types import CommittedSet

    engines = [EngineActor(kind="torch", model_path=model_path, eos_token_ids=(), seed=0) for _ in range(2)]
    weights = {0: {k: v.clone() for k, v in engines[0].engine.model.state_dict().items()}}
    cfg = RolloutConfig(n=N, max_tokens=SHORT, groups_per_sync=GROUPS_PER_SYNC, staleness_threshold=0.0,
                        max_concurrent=4)
    # The synchronous workflow, its rounds ending at 3 complete groups (not the step's 2).
    partial = PartialRolloutConfig(enable=True, max_age=3, truncate_at="threshold", threshold=3 * N)
    prompts = long_tail_prompts(40)

    def rollouter(state=None) -> Rollouter:
        aggregator = AggregatorActor(engines, threshold=partial.resolved_threshold(GROUPS_PER_SYNC, N))
        return Rollouter(cfg, engines, MemorySink(), prompts, lambda prompt, ids: float(len(ids)), state=state,
                         partial=partial, aggregator=aggregator)

    try:
        # Round 0 admits 4 prompts; the three short groups end it, so the long one (index 0)
        # is truncated and waits in the buffer for a round that never comes: the run stops there.
        first = rollouter()
        task = asyncio.create_task(first.run(num_groups=4))
        await until(lambda: len(first.partials) == N and len(first.producer.groups) == 3, timeout=180, what="truncated responses")
        await first.stop()
        await task
        saved = json.loads(json.dumps(first.snapshot()))  # what the checkpoint sidecar holds
        assert list(saved["partials"]) == ["sample_0_0"] and set(saved["partials"]["sample_0_0"]) == {"0", "1"}
        parts = saved["partials"]["sample_0_0"]
        assert all(p["age"] == 1 and 1 <= len(p["response_ids"]) < LONG for p in parts.values())
        assert all(len(p["response_ids"]) == len(p["logprobs"]) == len(p["versions"]) for p in parts.values())

        # The three short groups were trained; sample 0 is pending and takes its parts along.
        trained = CommittedSet(g.sample_id for g in first.producer.groups)
        state = RolloutState.resume(saved, trained, dropped=0, rows=len(prompts))
        assert state.pending == [0] and set(state.partials) == {"sample_0_0"}
        assert RolloutState.resume(saved, CommittedSet([*trained, "sample_0_0"]), 0, len(prompts)).partials == {}

        second = rollouter(state)
        await asyncio.wait_for(second.run(num_groups=1), 120)
    finally:
        for e in engines:
            await e.close()
    [group] = second.producer.groups
    assert group.sample_id == "sample_0_0" and group.complete and second.stats.resumed == N
    for t in group.trajectories:
        p = parts[str(t.index)]
        k = len(p["response_ids"])
        # It went on from its parts: same tokens, log-probs and versions, then the rest of its budget.
        assert len(t.response_ids) == LONG and t.age == 1
        assert t.response_ids[:k].tolist() == p["response_ids"] and t.versions[:k].tolist() == p["versions"]
        assert np.array_equal(t.logprobs[:k], np.asarray(p["logprobs"], dtype=np.float32))
    assert second.snapshot()["partials"] == {}
    # Every token, before the checkpoint and after the resume, has the behaviour log-prob of the
    # weights that sampled it (no sync here: version 0 throughout).
    worst, checked = worst_logprob_error(model_path, weights, group.trajectories)
    assert checked == N * LONG and worst <= 1e-4, worst


class _SignalSpy(EngineActor):
    """An `EngineActor` that records the round signals it is sent."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.signals: list[tuple] = []

    async def truncate(self, version, queued=False):
        self.signals.append(("truncate", version, queued))
        return await super().truncate(version, queued)

    async def reopen(self, version):
        self.signals.append(("reopen", version))
        await super().reopen(version)


async def test_a_replica_started_again_gets_the_round_signals_and_the_dead_one_none(model_path):
    """Engine restart in ``mode=sync`` with partial rollout: once `AggregatorActor.replace_engine`
    took the new replica, a round's end stops the new replica's running request (it comes back
    truncated, with its tokens) and nothing is sent to the dead one."""
    live, dead, fresh = (_SignalSpy(kind="torch", model_path=model_path, eos_token_ids=(), seed=0) for _ in range(3))
    aggregator = AggregatorActor([live, dead], threshold=None)
    running = None
    try:
        await dead.close()  # its engine died; the restarter started `fresh` in its place
        await aggregator.replace_engine(1, fresh)
        await aggregator.start_round(0, need=N)
        assert dead.signals == [] and fresh.signals == [("reopen", 0)]
        request = GenerateRequest("g/0", np.array([1, 4, 5], dtype=np.int64), max_tokens=240,
                                  sampling=SamplingParams(seed=0))
        running = asyncio.ensure_future(fresh.generate(request, True))
        await asyncio.sleep(0)  # let the request enqueue: before that, "not in flight" ends the wait at once
        assert await fresh.wait_for_tokens("g/0", 1, timeout_s=60) >= 1
        assert await aggregator.report(0, {0: 1, 1: 1}) is True  # the round has its N trajectories
        assert dead.signals == [] and fresh.signals[-1] == ("truncate", 0, True) == live.signals[-1]
        result = await asyncio.wait_for(running, 60)
        assert result.finish_reason == "truncated" and 0 < len(result.response_ids) < 240
        assert aggregator.truncated_rounds == {0: 1}
    finally:
        if running is not None:
            running.cancel()
        for e in (live, dead, fresh):
            await e.close()
