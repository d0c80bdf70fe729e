"""Defaults that follow from other values: OmegaConf interpolations and the resolvers they call."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from omegaconf import OmegaConf

from asyncrl.config.flags import named

if TYPE_CHECKING:
    from asyncrl.config.root import RunConfig



def _window(per_step: int, checkpoint_every: int, per_sync: int, staleness: float) -> int:
    # Groups are acked once the checkpoint holding their step is written, so the window covers
    # a checkpoint interval plus what the Rollouter may run ahead of the next sync.
    return per_step * checkpoint_every + int((1 + staleness) * per_sync) + 1


OmegaConf.register_resolver("asyncrl.mul", lambda *xs: _product(xs), replace=True)
OmegaConf.register_resolver("asyncrl.min", lambda *xs: min(xs), replace=True)
OmegaConf.register_resolver("asyncrl.max", lambda *xs: max(xs), replace=True)
OmegaConf.register_resolver("asyncrl.window", _window, replace=True)


def _product(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


_PER_STEP = "${asyncrl.mul:${trainer.groups_per_batch},${trainer.require_batches}}"
_PER_SYNC = ("${asyncrl.mul:${trainer.groups_per_batch},${trainer.require_batches},"
             "${trainer.trigger_parameter_sync_step}}")
DERIVED: dict[str, str] = {
    "rollout.max_concurrent": "${asyncrl.max:4,${trainer.groups_per_batch}}",
    "rollout.seed": "${seed}",
    "trainer.checkpoint_every": "${asyncrl.min:10,${steps}}",
    "stream.window": (f"${{asyncrl.window:{_PER_STEP},${{trainer.checkpoint_every}},{_PER_SYNC},"
                      "${rollout.staleness_threshold}}"),
}
"""Defaults that follow from other values (interpolations, resolved when the config is); a user may
set one (`check` refuses a value that contradicts what it follows from)."""


def _workers(cfg: RunConfig) -> tuple[Any, str]:
    e = cfg.engine
    return cfg.workers_per_engine, (f"the engines: engine.kind={cfg.engine_kind} with engine.tensor_parallel_size="
                                    f"{e.tensor_parallel_size} has {cfg.workers_per_engine} worker(s) per replica")


def _groups_per_sync(cfg: RunConfig) -> tuple[Any, str]:
    t = cfg.trainer
    return cfg.groups_per_sync, (f"trainer.groups_per_sync = trainer.groups_per_batch x trainer.require_batches x "
                                 f"trainer.trigger_parameter_sync_step = {t.groups_per_batch} x {t.require_batches} x "
                                 f"{t.trigger_parameter_sync_step} = {cfg.groups_per_sync}, which the Rollouter takes")


def _temperature(cfg: RunConfig) -> tuple[Any, str]:
    return cfg.rollout.temperature, (f"{named('rollout.temperature')}={cfg.rollout.temperature}: the loss uses the "
                                     "temperature the engines sampled at; set that")


COMPUTED: dict[str, Callable[[RunConfig], tuple[Any, str]]] = {
    "weight_sync.workers_per_engine": _workers,
    "trainer.algorithm.temperature": _temperature,
    "rollout.groups_per_sync": _groups_per_sync,
}
"""Keys that are not settings (not in the schema): the value follows from others, given here as
(value, what it follows from). A config.yaml printed before they left the schema holds them, so a
given value that agrees is accepted; one that contradicts is refused (`asyncrl.config.loader`)."""

