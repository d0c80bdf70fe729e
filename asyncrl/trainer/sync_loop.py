"""On-policy synchronous GRPO: generate, reward, train one step, load the weights, repeat.

The reference point for the asynchronous system: ``staleness_threshold=0`` and
``trigger_parameter_sync_step=1`` with no overlap between generation and training. Each step

1. samples ``n`` responses per prompt with the built-in `TorchEngine` (temperature ``T``,
   per-request seeds), scores them with the built-in arithmetic reward and forms `Group`s;
2. runs one `Trainer.train_step` on them through a `asyncrl.queue.memory.MemorySource`;
3. pushes the new weights into the engine with `asyncrl.sync.inprocess.InProcessSyncer`
   (``pause("keep") -> load_weights -> finish_weight_update -> resume``).

Run the full curve with ``python scripts/learn_sync.py``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from asyncrl import skip as skipping
from asyncrl.rollouter.rollouter import RolloutConfig, Rollouter, RolloutState, encode_prompts
from asyncrl.sync.inprocess import InProcessSyncer
from asyncrl.tasks import arithmetic
from asyncrl.trainer.config import TrainerConfig
from asyncrl.trainer.ranks import RankGroup
from asyncrl.queue.memory import MemorySink, MemorySource
from asyncrl.trainer.trainer import Trainer
from asyncrl.types import Group, parse_sample_id


@dataclass(kw_only=True)
class SyncGRPOConfig:
    """One on-policy GRPO run on the built-in arithmetic task."""

    trainer: TrainerConfig
    """Trainer settings; one step takes ``groups_per_batch * require_batches`` prompts."""
    steps: int = 20
    """Generate-then-train iterations."""
    n: int = 8
    """Responses per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's ``algorithm.temperature`` must match it."""
    seed: int = 0
    """Seeds the prompts and every request's sampler."""
    task: arithmetic.ArithmeticTaskConfig = field(default_factory=arithmetic.ArithmeticTaskConfig)
    skip: skipping.SkipConfig = field(default_factory=skipping.SkipConfig)
    """``skip.rollout`` replays whole steps' batches (step = the train step, from 0)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.n < 2:
            raise ValueError(f"need steps >= 1 and n >= 2 (GRPO compares siblings), got {self.steps=}, {self.n=}")
        if self.trainer.worker.algorithm.temperature != self.temperature:
            raise ValueError(f"trainer.worker.algorithm.temperature={self.trainer.worker.algorithm.temperature} must "
                             f"equal temperature={self.temperature}, or the loss is off-policy by construction")


@skipping.SkipManager.annotate(role="rollout")
async def rollout(engine, tokenizer, rows: list[dict], *, first_index: int, n: int, temperature: float,
                  max_tokens: int, seed: int) -> list[Group]:
    """``n`` scored responses for each prompt row, as groups ``sample_0_{first_index + i}``.

    The same `Rollouter` the asynchronous pipeline runs, with its gate wide open: every row is
    admitted at once and the groups are collected, in feed order, instead of streamed. The
    ``rollout`` skip role may answer the whole call from the dump of the step `SkipManager.set_step`
    was given.
    """
    collected = MemorySink()
    cfg = RolloutConfig(n=n, max_tokens=max_tokens, temperature=temperature, groups_per_sync=len(rows),
                        max_concurrent=len(rows), seed=seed)

    def reward(prompt, response_ids: np.ndarray) -> float:
        return arithmetic.reward(prompt.text, arithmetic.decode_response(tokenizer, response_ids))

    prompts = encode_prompts(tokenizer, rows, encode=arithmetic.encode_prompt)
    rollouter = Rollouter(cfg, [engine], collected, prompts, reward, state=RolloutState(next_index=first_index))
    await rollouter.run(num_groups=len(rows))
    return sorted(collected.groups, key=lambda g: parse_sample_id(g.sample_id)[1])


async def learn_sync(cfg: SyncGRPOConfig, ranks: RankGroup, engine, tokenizer, on_step=None) -> list[dict]:
    """Run ``cfg.steps`` generate-then-train steps; returns (and passes to ``on_step``) each step's metrics."""
    prompts_per_step = cfg.trainer.groups_per_batch * cfg.trainer.require_batches
    data = arithmetic.generate_dataset(prompts_per_step * cfg.steps, seed=cfg.seed, config=cfg.task)
    source = MemorySource()
    trainer = Trainer(cfg.trainer, ranks, source, InProcessSyncer(ranks, [engine]))
    rollout_cfg = RolloutConfig(n=cfg.n, max_tokens=cfg.task.max_response_tokens, temperature=cfg.temperature,
                                seed=cfg.seed)
    skipping.SkipManager.init(cfg.skip, shape=skipping.rollout_shape(
        rollout_cfg, model=skipping.model_fingerprint(engine.config.model_path),
        # The generator is seeded and sequential: row i is the same whatever the number of steps.
        data=f"builtin:arithmetic:seed={cfg.seed}:{dataclasses.asdict(cfg.task)}",
        reward="builtin:arithmetic", groups_per_step=prompts_per_step))
    history = []
    for step in range(cfg.steps):
        skipping.SkipManager.set_step(step)
        t0 = time.perf_counter()
        rows = data[step * prompts_per_step:(step + 1) * prompts_per_step]
        for g in await rollout(engine, tokenizer, rows, first_index=step * prompts_per_step, n=cfg.n,
                               temperature=cfg.temperature, max_tokens=cfg.task.max_response_tokens, seed=cfg.seed):
            source.put(g)
        t1 = time.perf_counter()
        result = await trainer.train_step()
        metrics = dict(result.metrics, generate_s=t1 - t0, train_sync_s=time.perf_counter() - t1,
                       engine_version=engine.version)
        history.append(metrics)
        if on_step is not None:
            on_step(metrics)
    return history
