"""Learning: on-policy synchronous GRPO with the built-in engine raises the reward on the
built-in addition task (a reduced run of ``scripts/learn_sync.py``; fixed seeds)."""

import pytest
import ray
import torch

from asyncrl.models import default_model_path
from asyncrl.models.tiny import build_tokenizer
from asyncrl.rollouter.torch_engine import TorchEngine
from asyncrl.trainer.config import AlgorithmConfig, OptimConfig, TrainerConfig, WorkerConfig
from asyncrl.trainer.ranks import RankGroup
from asyncrl.trainer.sync_loop import SyncGRPOConfig, learn_sync

STEPS, PROMPTS, N, WINDOW = 30, 32, 8, 5


@pytest.mark.slow
async def test_sync_grpo_raises_mean_reward():
    torch.set_num_threads(1)
    model = str(default_model_path())  # warm-started: mixed rewards within groups from the start
    tok = build_tokenizer()
    cfg = SyncGRPOConfig(
        trainer=TrainerConfig(
            worker=WorkerConfig(model_path=model, micro_batch_size=32, pad_token_id=tok.pad_token_id,
                                algorithm=AlgorithmConfig(loss_agg_mode="token-mean"),
                                optim=OptimConfig(lr=3e-3, warmup_steps=2)),
            groups_per_batch=PROMPTS, cpus_per_rank=1),
        steps=STEPS, n=N, seed=0,
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    ranks = engine = None
    try:
        ranks = RankGroup.start_ray(cfg.trainer)
        engine = TorchEngine(model, max_running=PROMPTS * N, seed=0)
        history = await learn_sync(cfg, ranks, engine, tok)
    finally:
        if engine is not None:
            await engine.close()
        if ranks is not None:
            ranks.close()
        ray.shutdown()
    assert [m["step"] for m in history] == list(range(1, STEPS + 1))
    # Every step trained on fresh on-policy samples and pushed its weights into the engine.
    assert all(m["staleness_max"] == 0 for m in history)
    assert engine.version == STEPS and history[-1]["engine_version"] == STEPS
    first = sum(m["reward_mean"] for m in history[:WINDOW]) / WINDOW
    last = sum(m["reward_mean"] for m in history[-WINDOW:]) / WINDOW
    print(f"sync GRPO: mean reward first {WINDOW} steps {first:.3f} -> last {WINDOW} steps {last:.3f}")
    assert last >= first + 0.1, f"mean reward first {WINDOW} steps {first:.3f}, last {WINDOW} steps {last:.3f}"
