"""A Trainer step on a real (in-process, gloo) rank with multi-turn groups: observation tokens
(``loss_mask`` 0) change nothing in the step's loss, gradient norm, entropy or ratios whatever
the records carry there, and the step's token metrics count model tokens only."""

import numpy as np
import pytest

from asyncrl.trainer.config import OptimConfig, TrainerConfig, WorkerConfig
from asyncrl.trainer.ranks import RankGroup
from asyncrl.trainer.trainer import MemorySource, Trainer
from asyncrl.trainer.worker import TrainerWorker
from asyncrl.types import Group, Trajectory
from asyncrl.net import free_port


def conversation_group(i: int, *, garbage: bool, n: int = 4) -> Group:
    """Group ``sample_0_{i}``: each response a turn, an observation of 3-5 tokens, a turn."""
    rng = np.random.default_rng(2000 + i)
    sid = f"sample_0_{i}"
    trajs = []
    for k in range(n):
        first, obs, second = (int(x) for x in rng.integers(1, 5, 3))
        obs += 2
        mask = np.array([1] * first + [0] * obs + [1] * second, np.uint8)
        r = rng.integers(3, 40, size=len(mask))
        logprobs = rng.uniform(-4, -3, size=len(r)).astype(np.float32)
        versions = np.zeros(len(r), np.int64)
        logprobs[mask == 0], versions[mask == 0] = (np.nan, 50) if garbage else (0.0, -1)
        trajs.append(Trajectory(sample_id=sid, index=k, prompt_ids=rng.integers(3, 40, size=4), response_ids=r,
                                logprobs=logprobs, versions=versions, finish_reason="max_turns",
                                reward=float(rng.integers(0, 2)), loss_mask=mask, turns=2))
    return Group(sample_id=sid, trajectories=trajs, expected=n)


def config(model_path) -> TrainerConfig:
    return TrainerConfig(worker=WorkerConfig(model_path=str(model_path), micro_batch_size=3,
                                             optim=OptimConfig(lr=1e-2)),
                         groups_per_batch=2, recv_timeout_s=5.0, max_version_gap=0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    import torch

    from asyncrl.models.tiny import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


async def step_metrics(model_path, *, garbage: bool) -> dict:
    cfg = config(model_path)
    # A fresh rank each time (the process group is set up once): the same initial weights.
    ranks = RankGroup([TrainerWorker(cfg.worker, rank=0, world_size=1, master_port=free_port())], remote=False)
    source = MemorySource([conversation_group(i, garbage=garbage) for i in range(2)])
    result = await Trainer(cfg, ranks, source).train_step()
    assert result.dropped == []  # version -1 / 50 on observations is no staleness: max_version_gap=0 keeps them
    return result.metrics


async def test_observation_tokens_change_nothing_in_a_real_step_and_are_not_counted(model_path):
    clean = await step_metrics(model_path, garbage=False)
    dirty = await step_metrics(model_path, garbage=True)
    for key in ("loss", "grad_norm", "entropy", "clip_frac", "is_ratio_mean", "is_ratio_max", "is_ratio_min",
                "staleness_max", "response_length_mean"):
        assert np.isfinite(clean[key]) and dirty[key] == clean[key], key
    groups = [conversation_group(i, garbage=False) for i in range(2)]
    model_tokens = [int(t.loss_mask.sum()) for g in groups for t in g.trajectories]
    assert clean["response_length_mean"] == pytest.approx(np.mean(model_tokens))
    assert clean["response_length_max"] == max(model_tokens)
    assert clean["staleness_max"] == 0.0 and clean["fully_async/partial/max_partial_span"] == 0.0
