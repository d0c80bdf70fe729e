"""Defaults that follow from other values: OmegaConf interpolations and the resolvers they call."""

from __future__ import annotations

from omegaconf import OmegaConf

from asyncrl.config.engine import workers_per_engine



def _window(per_step: int, checkpoint_every: int, per_sync: int, staleness: float) -> int:
    # Groups are acked once the checkpoint holding their step is written, so the window covers
    # a checkpoint interval plus what the Rollouter may run ahead of the next sync.
    return per_step * checkpoint_every + int((1 + staleness) * per_sync) + 1


OmegaConf.register_resolver("asyncrl.mul", lambda *xs: _product(xs), replace=True)
OmegaConf.register_resolver("asyncrl.min", lambda *xs: min(xs), replace=True)
OmegaConf.register_resolver("asyncrl.max", lambda *xs: max(xs), replace=True)
OmegaConf.register_resolver("asyncrl.window", _window, replace=True)
OmegaConf.register_resolver("asyncrl.workers_per_engine", workers_per_engine, replace=True)


def _product(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


_PER_STEP = "${asyncrl.mul:${trainer.groups_per_batch},${trainer.require_batches}}"
_PER_SYNC = ("${asyncrl.mul:${trainer.groups_per_batch},${trainer.require_batches},"
             "${trainer.trigger_parameter_sync_step}}")
DERIVED: dict[str, str] = {
    "rollout.groups_per_sync": _PER_SYNC,
    "rollout.max_concurrent": "${asyncrl.max:4,${trainer.groups_per_batch}}",
    "rollout.seed": "${seed}",
    "trainer.algorithm.temperature": "${rollout.temperature}",
    "trainer.checkpoint_every": "${asyncrl.min:10,${steps}}",
    "weight_sync.workers_per_engine": ("${asyncrl.workers_per_engine:${engine.kind},${placement.rollouter_gpus},"
                                       "${engine.tensor_parallel_size}}"),
    "stream.window": (f"${{asyncrl.window:{_PER_STEP},${{trainer.checkpoint_every}},{_PER_SYNC},"
                      "${rollout.staleness_threshold}}"),
}
"""Defaults that follow from other values (interpolations, resolved when the config is)."""

