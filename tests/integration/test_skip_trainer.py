"""How the Trainer treats replayed groups: versions re-based (``max_version_gap`` judges them as
produced now), behaviour log-probs kept (exactly the trainer's own log-probs when the replay
starts from the same initial weights), a temperature mismatch refused."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from asyncrl.skip import REPLAY_KEY, SkipConfig, SkipManager, SkipRoleConfig, is_replayed, rollout_shape
from asyncrl.types import Group
from asyncrl.queue.memory import MemorySink

T = 600.0




async def rollouter_run(model_path, dump_dir, cfg) -> tuple[list[Group], int]:
    from asyncrl.rollouter.rollouter import Prompt, Rollouter
    from asyncrl.rollouter.engines.builtin.engine import TorchEngine

    SkipManager.init(SkipConfig(experiment="trainer", async_rollout=SkipRoleConfig(
        enable=True, dump_dir=str(dump_dir), steps=[0, 1])),
        shape=rollout_shape(cfg, model=str(model_path), data="two-prompts", reward="rank"))
    engine = TorchEngine(model_path, eos_token_ids=())
    prompts = [Prompt(text=f"p{i}", prompt_ids=np.array([1, 4 + i, 5, 6], dtype=np.int64)) for i in range(2)]
    producer = MemorySink()
    try:
        # Reward = the first response token, so the group's advantages are not all zero.
        await asyncio.wait_for(Rollouter(cfg, [engine], producer, prompts, lambda _, r: float(r[0] % 3))
                               .run(num_groups=2), 120)
        return sorted(producer.groups, key=lambda g: g.sample_id), engine.stats()["requests"]
    finally:
        await engine.close()
        SkipManager.reset()


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    from asyncrl.models.tiny import build_tiny_model
    from asyncrl.rollouter.rollouter import RolloutConfig

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("skip_trainer")
    model = build_tiny_model(root / "model")
    cfg = RolloutConfig(n=4, max_tokens=5, groups_per_sync=100, seed=3)
    generated, _ = asyncio.run(rollouter_run(model, root / "dumps", cfg))
    groups, requests = asyncio.run(rollouter_run(model, root / "dumps", cfg))
    assert requests == 0 and all(map(is_replayed, groups)) and not any(map(is_replayed, generated))
    return model, groups


def trainer(model, **kw):
    from asyncrl.trainer.config import OptimConfig, TrainerConfig, WorkerConfig

    return TrainerConfig(worker=WorkerConfig(model_path=str(model), micro_batch_size=8, optim=OptimConfig(lr=1e-3)),
                         groups_per_batch=2, recv_timeout_s=5.0, **kw)


async def test_replayed_groups_are_rebased_and_trained_on_their_behaviour_logprobs(replayed):
    from asyncrl.trainer.ranks import RankGroup
    from asyncrl.trainer.trainer import MemorySource, Trainer

    model, groups = replayed
    # The same dumped groups without the replay mark, under other ids: to the Trainer they are
    # ordinary groups of version 0.
    plain = [Group(sample_id=f"sample_0_{10 + i}", trajectories=[_renamed(t, f"sample_0_{10 + i}") for t in g.trajectories],
                   expected=g.expected, meta={k: v for k, v in g.meta.items() if k != REPLAY_KEY})
             for i, g in enumerate(groups)]
    cfg = trainer(model, max_version_gap=0)
    ranks = RankGroup.start_local(cfg)
    try:
        source = MemorySource([*plain, *groups])
        t = Trainer(cfg, ranks, source)
        t.version = 3  # as after three weight syncs: the dumped version-0 tokens are 3 behind
        result = await t.train_step()
    finally:
        ranks.close()
    # Unmarked version-0 groups are stale at version 3 with max_version_gap=0; the replayed ones are not.
    assert [sid for sid, _ in result.dropped] == ["sample_0_10", "sample_0_11"]
    assert all(reason.startswith("stale") for _, reason in result.dropped)
    assert result.sample_ids == ["sample_0_0", "sample_0_1"]
    m = result.metrics
    assert m["replayed_groups"] == 2 and m["staleness_max"] == 0.0
    # Same initial weights as the run that dumped them: the dumped behaviour log-probs are the
    # trainer's own, so every importance ratio is 1 before the update.
    assert m["is_ratio_max"] == pytest.approx(1.0, abs=1e-3) and m["is_ratio_min"] == pytest.approx(1.0, abs=1e-3)
    assert m["clip_frac"] == 0.0


def test_rebased_group_keeps_tokens_and_logprobs(replayed):
    from asyncrl.skip import rebase_versions

    _, groups = replayed
    g = rebase_versions(groups[0], 7)
    assert g.meta[REPLAY_KEY]["rebased_to_version"] == 7
    for new, old in zip(g.trajectories, groups[0].trajectories):
        assert (new.versions == 7).all() and (old.versions == 0).all()
        assert np.array_equal(new.logprobs, old.logprobs) and np.array_equal(new.response_ids, old.response_ids)


async def test_replayed_logprobs_at_another_temperature_are_refused(replayed):
    from asyncrl.trainer.ranks import RankGroup
    from asyncrl.trainer.trainer import MemorySource, Trainer

    model, groups = replayed
    assert groups[0].meta[REPLAY_KEY]["temperature"] == 1.0
    hot = Group(sample_id=groups[0].sample_id, trajectories=groups[0].trajectories, expected=groups[0].expected,
                meta={**groups[0].meta, REPLAY_KEY: {**groups[0].meta[REPLAY_KEY], "temperature": 0.7}})
    cfg = trainer(model)
    ranks = RankGroup.start_local(cfg)
    try:
        with pytest.raises(ValueError, match="temperature 0.7, but algorithm.temperature=1.0"):
            await Trainer(cfg, ranks, MemorySource([hot, groups[1]])).train_step()
    finally:
        ranks.close()


def _renamed(t, sample_id):
    from asyncrl.types import Trajectory

    return Trajectory(sample_id=sample_id, index=t.index, prompt_ids=t.prompt_ids, response_ids=t.response_ids,
                      logprobs=t.logprobs, versions=t.versions, finish_reason=t.finish_reason, reward=t.reward)
