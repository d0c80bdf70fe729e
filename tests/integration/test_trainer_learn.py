"""Learning: on-policy synchronous GRPO with the built-in engine raises the reward on the
built-in addition task, in one process: generate a batch with the `Rollouter` on an in-process
`TorchEngine`, train one `Trainer` step on it (FSDP2 ranks on Ray), push the weights with the
in-process syncer, repeat (the launcher's ``--mode sync`` runs the same lockstep across processes).

It starts from the shipped default policy (the same weights on every machine), and asserts
margins well inside what the run gains (measured figures beside the asserts), so a
different float rounding of the RL run itself does not decide the outcome.
"""

import time

import numpy as np
import pytest
import ray
import torch

from asyncrl.models import default_model_path
from asyncrl.models.tiny import build_tokenizer
from asyncrl.placement import start_local_ray
from asyncrl.rollouter.engines.builtin.engine import TorchEngine
from asyncrl.tasks import arithmetic
from asyncrl.trainer.config import AlgorithmConfig, OptimConfig, TrainerConfig, WorkerConfig
from asyncrl.queue.memory import MemorySource
from asyncrl.sync.inprocess import InProcessSyncer
from asyncrl.trainer.ranks import RankGroup
from asyncrl.trainer.trainer import Trainer

STEPS, PROMPTS, N, WINDOW = 30, 32, 8, 5
HELD_OUT = arithmetic.generate_dataset(64, seed=20_261_123)  # not the training prompts' seed


MAX_TOKENS = arithmetic.ArithmeticTaskConfig().max_response_tokens


async def held_out_reward(rollout_batch, engine, tok) -> float:
    """Mean sampled (T=1) reward over 64 held-out prompts x 8 responses, with fixed seeds."""
    groups = await rollout_batch(engine, tok, HELD_OUT, first_index=10**6, n=N, temperature=1.0,
                                 max_tokens=MAX_TOKENS, seed=7)
    return float(np.mean([t.reward for g in groups for t in g.trajectories]))


async def learn_sync(rollout_batch, cfg: TrainerConfig, ranks, engine, tok, steps: int, seed: int) -> list[dict]:
    """``steps`` x (generate ``groups_per_batch`` groups, train one step, load the weights into the engine)."""
    data = arithmetic.generate_dataset(cfg.groups_per_batch * steps, seed=seed)
    source = MemorySource()
    trainer = Trainer(cfg, ranks, source, InProcessSyncer(ranks, [engine]))
    history = []
    for step in range(steps):
        t0 = time.perf_counter()
        rows = data[step * cfg.groups_per_batch:(step + 1) * cfg.groups_per_batch]
        for g in await rollout_batch(engine, tok, rows, first_index=step * cfg.groups_per_batch, n=N,
                                     temperature=1.0, max_tokens=MAX_TOKENS, seed=seed):
            source.put(g)
        result = await trainer.train_step()
        history.append(dict(result.metrics, step_s=time.perf_counter() - t0, engine_version=engine.version))
    return history


@pytest.mark.slow
async def test_sync_grpo_raises_mean_reward(rollout_batch):
    from asyncrl.skip import SkipManager

    torch.set_num_threads(1)
    SkipManager.reset()  # no skip role: every batch is generated
    model = str(default_model_path())  # shipped warm start: mixed rewards within groups from the start
    tok = build_tokenizer()
    cfg = TrainerConfig(
        worker=WorkerConfig(model_path=model, micro_batch_size=32, pad_token_id=tok.pad_token_id,
                            algorithm=AlgorithmConfig(loss_agg_mode="token-mean", temperature=1.0),
                            optim=OptimConfig(lr=1e-3, warmup_steps=2)),
        groups_per_batch=PROMPTS, cpus_per_rank=1)
    start_local_ray(num_cpus=2, log_to_driver=False,
                    runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    ranks = engine = None
    try:
        ranks = RankGroup.start_ray(cfg)
        engine = TorchEngine(model, max_running=PROMPTS * N, seed=0)
        before = await held_out_reward(rollout_batch, engine, tok)
        history = await learn_sync(rollout_batch, cfg, ranks, engine, tok, STEPS, seed=0)
        after = await held_out_reward(rollout_batch, engine, tok)
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
    print(f"sync GRPO: mean reward first {WINDOW} steps {first:.3f} -> last {WINDOW} steps {last:.3f}; "
          f"held-out sampled reward {before:.3f} -> {after:.3f}")
    # Measured 2026-11-24 (head-32 demo model, lr 1e-3): 0.323 -> 0.549 (+0.23); held-out 0.334 -> 0.531 (+0.20).
    # At 3e-3, the former model's rate, held-out went 0.334 -> 0.414 only.
    assert last >= first + 0.1, f"mean reward first {WINDOW} steps {first:.3f}, last {WINDOW} steps {last:.3f}"
    # The same policy before and after, on prompts it never trained on, 512 samples each.
    assert after >= before + 0.1, f"held-out sampled reward {before:.3f} before, {after:.3f} after"
