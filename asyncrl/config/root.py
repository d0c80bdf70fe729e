"""`RunConfig`, the root: run-wide settings, the sections, what the parts need built from them,
and the checks across sections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from omegaconf import DictConfig

from asyncrl.config.data import DataConfig, ModelConfig, check_data
from asyncrl.config.engine import EngineConfig, check_engine, engine_settings, workers_per_engine
from asyncrl.config.errors import ConfigError
from asyncrl.config.flags import named
from asyncrl.config.placement import PlacementConfig, check_placement
from asyncrl.config.rollout import RolloutSection, rollout_config
from asyncrl.config.skip import RunSkipConfig
from asyncrl.config.stream import check_stream
from asyncrl.config.sync import WeightSyncSection, weight_sync_config
from asyncrl.config.section import values
from asyncrl.config.trainer import _FROM_PLACEMENT_OR_RUN, _WORKER_KEYS, TrainerSection, check_trainer
from asyncrl.metrics.config import MetricsConfig
from asyncrl.modes import check_mode
from asyncrl.queue.protocol import StreamConfig
from asyncrl.rollouter.partial import PartialRolloutConfig
from asyncrl.rollouter.config import RolloutConfig
from asyncrl.sync.config import WeightSyncConfig
from asyncrl.trainer.config import AlgorithmConfig, TrainerConfig, WorkerConfig


@dataclass(kw_only=True)
class RunConfig:
    """One run: every part's settings. Build it with `load_config`."""

    steps: int = 100
    """Train steps to run."""
    seed: int = 0
    """Seeds the dataset order of the built-in task, every request's sampler and torch."""
    run_dir: str | None = None
    """Where config.yaml, metrics.jsonl, the log and checkpoints go; None: runs/<time>."""
    mode: Literal["async", "sync"] = "async"
    """``async``: fully asynchronous; ``sync``: generate a batch, train, sync, in lockstep (`asyncrl.modes`)."""
    max_restarts: int = 2
    """Times the launcher starts the whole run again from its last checkpoint, in the same command,
    after a process of the run dies (a trainer rank, the Rollouter): exactly once, as ``--resume``.
    Each restart is printed and logged with its cause in ``<run_dir>/restarts.jsonl``. 0: the run
    stops at the first death (continue by hand with ``--resume``)."""
    restart_backoff_s: float = 5.0
    """Wait before restart k: ``k`` times this (a failing cluster gets time to settle)."""
    watchdog_s: float | None = None
    """A hang: no train step for this long dumps every process's stacks to ``<run_dir>/hang-<time>.txt``
    and restarts the run (`asyncrl.hang`). None: derived from the run's own step times, below."""
    watchdog_factor: float = 10.0
    """Derived deadline: this many times the median step time (after the first steps) ..."""
    watchdog_floor_s: float = 120.0
    """... but never below this."""
    watchdog_startup_s: float = 900.0
    """Deadline of the first steps (first generation, compilation), before there is a median."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutSection = field(default_factory=RolloutSection)  # type: ignore[valid-type]
    engine: EngineConfig = field(default_factory=EngineConfig)  # type: ignore[valid-type]
    trainer: TrainerSection = field(default_factory=TrainerSection)  # type: ignore[valid-type]
    weight_sync: WeightSyncSection = field(default_factory=WeightSyncSection)  # type: ignore[valid-type]
    stream: StreamConfig = field(default_factory=StreamConfig)
    partial_rollout: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    skip: RunSkipConfig = field(default_factory=RunSkipConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.restart_backoff_s < 0:
            raise ValueError(f"restart_backoff_s must be >= 0, got {self.restart_backoff_s}")
        for name in ("watchdog_factor", "watchdog_floor_s", "watchdog_startup_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.watchdog_s is not None and self.watchdog_s <= 0:
            raise ValueError(f"watchdog_s must be > 0 (or null: derived from the step times), got {self.watchdog_s}")

    # What the parts need, built from the sections.

    @property
    def model_path(self) -> str:
        """``model.path``, else the shipped warm-started model of the built-in task (``data.task``)."""
        if self.model.path is not None:
            return self.model.path
        from asyncrl.models import default_model_path

        return str(default_model_path(self.data.task))

    @property
    def gpu(self) -> bool:
        return self.placement.rollouter_gpus > 0

    @property
    def engine_kind(self) -> str:
        if self.engine.kind != "auto":
            return self.engine.kind
        return "vllm" if self.gpu else "torch"

    @property
    def engine_replicas(self) -> int:
        p = self.placement
        return p.rollouter_gpus // self.engine.tensor_parallel_size if self.gpu else p.engines

    @property
    def trainer_world_size(self) -> int:
        return self.placement.trainer_gpus if self.gpu else self.placement.trainer_ranks

    @property
    def groups_per_step(self) -> int:
        return self.trainer.groups_per_batch * self.trainer.require_batches

    @property
    def groups_per_sync(self) -> int:
        """The Trainer's groups between two weight syncs (`TrainerConfig.groups_per_sync`), which the
        Rollouter's config takes (`rollout_config`): the staleness budget's unit."""
        return self.groups_per_step * self.trainer.trigger_parameter_sync_step

    def rollout_config(self) -> RolloutConfig:
        """The Rollouter's own config: the ``rollout`` section plus the Trainer's `groups_per_sync`."""
        return rollout_config(self.rollout, self.groups_per_sync)

    def trainer_config(self, *, model_path: str, pad_token_id: int, checkpoint_dir: str | None,
                       samples_path: str | None = None, eos_token_id: int | None = None,
                       transcripts_path: str | None = None) -> TrainerConfig:
        """The Trainer's own config: the section plus what placement and the run decide."""
        t = self.trainer
        # The engines run past EOS on a long-tail workload (`engine_kwargs`); what follows it is not trained.
        stop = eos_token_id if self.data.long_tail > 1 else None
        # The loss divides logits by the temperature the engines sampled at: the rollout's, never another.
        algorithm = AlgorithmConfig(temperature=self.rollout.temperature, **values(t.algorithm))
        knobs = {k: getattr(t, k) for k in _WORKER_KEYS} | {"algorithm": algorithm}
        worker = WorkerConfig(model_path=model_path, pad_token_id=pad_token_id, stop_token_id=stop, seed=self.seed,
                              **knobs)
        loop = {f.name: getattr(t, f.name) for f in dataclasses.fields(TrainerConfig)
                if f.name not in _FROM_PLACEMENT_OR_RUN}
        return TrainerConfig(worker=worker, world_size=self.trainer_world_size,
                             gpus_per_rank=1.0 if self.placement.trainer_gpus else 0.0,
                             checkpoint_dir=checkpoint_dir, samples_path=samples_path,
                             transcripts_path=transcripts_path, **loop)

    @property
    def workers_per_engine(self) -> int:
        """Weight-sync group ranks per engine replica: its workers (``engine.tensor_parallel_size``
        for vLLM; the built-in engine is one process)."""
        return workers_per_engine(self.engine.kind, self.placement.rollouter_gpus, self.engine.tensor_parallel_size)

    def weight_sync_config(self) -> WeightSyncConfig:
        """The processes' `WeightSyncConfig`: the ``weight_sync`` section plus `workers_per_engine`,
        which follows from the engines. Every engine kind takes ``broadcast`` (vLLM's in its workers,
        `asyncrl.sync.vllm_broadcast`); vLLM on GPU may take ``vllm`` (its NCCL engine) instead."""
        return weight_sync_config(self.weight_sync, self.workers_per_engine)

    def engine_kwargs(self, model_path: str) -> dict:
        """Keyword settings of one engine replica (`make_engine(kind, **these)`)."""
        e = self.engine
        if self.engine_kind == "vllm":
            nccl = {"weight_transfer": "nccl"} if self.weight_sync.method == "vllm" else {}
            seqs = {"max_num_seqs": e.max_running} if e.max_running is not None else {}
            return dict(model_path=model_path, seed=self.seed, **engine_settings(e, "vllm"), **nccl, **seqs)
        # A long-tail workload ends each response at its own budget, not at the model's EOS.
        eos = {"eos_token_ids": ()} if self.data.long_tail > 1 else {}
        # With GPUs reserved for the Rollouter, Ray gives each replica its own (CUDA_VISIBLE_DEVICES).
        device = "cuda" if self.gpu else "cpu"
        slots = {"max_running": e.max_running} if e.max_running is not None else {}
        return dict(model_path=model_path, seed=self.seed, device=device, **engine_settings(e, "torch"), **slots, **eos)


def check(cfg: RunConfig, given: DictConfig | None = None) -> None:
    """Each section's own checks, then those across sections; raises `ConfigError` naming both sides.

    ``given`` holds what the user's files and overrides set (a key the launcher owns is refused
    only when given)."""
    check_placement(cfg.placement)
    check_engine(cfg.engine, cfg.engine_kind)
    check_trainer(cfg.trainer)
    check_stream(cfg.stream, given)
    check_data(cfg.data)
    _check_engines_and_sync(cfg)
    _check_batches_and_mode(cfg)


def _check_engines_and_sync(cfg: RunConfig) -> None:
    p, e, sync, kind = cfg.placement, cfg.engine, cfg.weight_sync, cfg.engine_kind
    if cfg.gpu and p.rollouter_gpus % e.tensor_parallel_size:
        raise ConfigError(f"{named('placement.rollouter_gpus')}={p.rollouter_gpus} is not a multiple of "
                          f"engine.tensor_parallel_size={e.tensor_parallel_size} (GPUs per replica)")
    if sync.method == "vllm" and not (kind == "vllm" and cfg.gpu):
        raise ConfigError(f"{named('weight_sync.method')}=vllm (vLLM's NCCL transfer engine) needs engine.kind=vllm "
                          f"on GPUs, got engine.kind={kind} with {named('placement.rollouter_gpus')}="
                          f"{p.rollouter_gpus}: leave it unset (broadcast serves every engine)")
    lora = cfg.trainer.lora
    if lora.enabled and (sync.method != "broadcast" or kind not in ("torch", "vllm")):
        raise ConfigError(f"trainer.lora.rank={lora.rank} syncs adapters with {named('weight_sync.method')}=broadcast "
                          f"into a torch or vllm engine, got method={sync.method}, "
                          f"engine.kind={kind}: set those, or trainer.lora.rank=0")
    from asyncrl.rollouter.engines.backends import check_temperature

    try:
        check_temperature(kind, cfg.rollout.temperature, named("rollout.temperature"))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_batches_and_mode(cfg: RunConfig) -> None:
    t, r = cfg.trainer, cfg.rollout
    held = cfg.groups_per_step * t.checkpoint_every
    if cfg.stream.window <= held:
        raise ConfigError(f"stream.window={cfg.stream.window} must exceed the groups of one checkpoint interval, "
                          f"trainer.groups_per_batch x trainer.require_batches x trainer.checkpoint_every = {held} "
                          "(groups are acked only when their checkpoint is written; the stream would stall)")
    if r.agent.enabled and cfg.data.long_tail > 1:
        raise ConfigError("data.long_tail sets single-turn response budgets; it does not apply to an agent loop "
                          "(rollout.agent.env/loop)")
    try:
        check_mode(cfg.mode, staleness_threshold=r.staleness_threshold, partial=cfg.partial_rollout,
                   trigger_parameter_sync_step=t.trigger_parameter_sync_step)
    except ValueError as err:
        raise ConfigError(f"{named('mode')}: {err}") from None
    threshold = cfg.partial_rollout.threshold
    if cfg.partial_rollout.enable and threshold is not None:
        if cfg.mode != "sync":
            raise ConfigError(f"partial_rollout.threshold={threshold} applies to {named('mode')}=sync: in async mode "
                              "a round's long tail is truncated at each weight sync; remove it")
        reachable = r.max_concurrent * r.n
        if threshold > reachable:
            raise ConfigError(f"partial_rollout.threshold={threshold} can never be reached: a round holds at most "
                              f"rollout.max_concurrent x {named('rollout.n')} = {reachable} trajectories")
