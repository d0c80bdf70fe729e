"""Build the fully async pipeline on Ray and run it: what ``python -m asyncrl.launch`` does.

::

    EngineActor x E ◄── Rollouter actor ──► StreamProducer ══ZeroMQ══► StreamConsumer (here)
          ▲                                                              │
          └──── WeightSyncCoordinator ◄── every K steps ── Trainer ◄─────┘
                 (pause keep, broadcast, load, resume)       └─► TrainerWorker x T (FSDP2)

The Trainer's driver loop runs in this process, with the stream's consumer; the Rollouter,
the engines and the trainer ranks are Ray actors (separate processes). Every process emits
metrics on the run's metric stream (`asyncrl.metrics`), whose sinks write
``<run_dir>/metrics.jsonl`` (and more); checkpoints go to ``<run_dir>/checkpoints``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.rollouter.rollouter import RolloutConfig, Rollouter, RolloutState, encode_prompts


def load_callable(spec: str):
    """``module:function`` -> the function; ValueError names a malformed or missing spec."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--reward must look like 'module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"--reward {spec!r}: {module} has no callable {name!r}")
    return fn


def load_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not a JSON object ({e.msg})") from None
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


class RolloutWorker:
    """The Rollouter process: tokenizer, dataset, reward, producer and `Rollouter` (a Ray actor)."""

    def __init__(self, cfg: RolloutConfig, engines: list, endpoint: str, window: int, model_path: str,
                 dataset: str | None, reward: str | None, seed: int, state: dict | None = None,
                 metrics_endpoint: str | None = None, metrics_interval_s: float = 1.0):
        from transformers import AutoTokenizer

        from asyncrl.tasks import arithmetic

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        if dataset is None:
            rows = arithmetic.generate_dataset(4096, seed=seed)
            prompts = encode_prompts(self.tokenizer, rows, encode=arithmetic.encode_prompt)
        else:
            prompts = encode_prompts(self.tokenizer, load_jsonl(dataset))
        score = load_callable(reward) if reward else arithmetic.reward
        eos = self.tokenizer.eos_token_id

        def reward_fn(prompt_text: str, response_ids: np.ndarray) -> float:
            ids = [int(t) for t in response_ids]
            if eos in ids:
                ids = ids[: ids.index(eos)]
            return score(prompt_text, self.tokenizer.decode(ids, skip_special_tokens=True))

        self.cfg, self.engines, self.prompts, self.reward_fn = cfg, engines, prompts, reward_fn
        self.endpoint, self.window = endpoint, window
        self.metrics_endpoint, self.metrics_interval_s = metrics_endpoint, metrics_interval_s
        self.state = RolloutState(**(state or {}))
        self.version = 0
        self.rollouter: Rollouter | None = None

    async def run(self, num_groups: int | None = None) -> dict:
        from asyncrl.queue import StreamConfig, StreamProducer

        producer = StreamProducer(StreamConfig(endpoint=self.endpoint, window=self.window), producer_id="rollouter-0")
        await producer.start()
        engines, report = self.engines, None
        if self.metrics_endpoint:  # metrics (#16): idle clock on the engines, periodic report
            from asyncrl.metrics.report import IdleClock, MeteredEngine, RolloutReporter, report_rollouter
            from asyncrl.metrics.stream import MetricsEmitter

            clock, emitter = IdleClock(), MetricsEmitter(self.metrics_endpoint, "rollouter")
            engines = [MeteredEngine(e, clock) for e in self.engines]
            report = asyncio.create_task(report_rollouter(
                emitter, RolloutReporter(self.engines, clock, self.cfg.n), lambda: (self.rollouter, producer),
                self.metrics_interval_s))
        self.rollouter = Rollouter(self.cfg, engines, producer, self.prompts, self.reward_fn, state=self.state)
        await self.rollouter.on_sync(self.version)  # a sync may have landed before run() started
        try:
            await self.rollouter.run(num_groups)
        finally:
            if report is not None:
                report.cancel()
                await asyncio.gather(report, return_exceptions=True)
                emitter.close()
            await producer.close()
        return self.progress()

    async def on_sync(self, version: int) -> None:
        self.version = version
        if self.rollouter is not None:
            await self.rollouter.on_sync(version)

    def feed_state(self) -> dict:
        """The feed position, for the Trainer's checkpoint (``rollouter_state`` slot)."""
        return dataclasses.asdict(self.state)

    def progress(self) -> dict:
        r = self.rollouter
        return {} if r is None else {"admitted": r.admitted, "sent": r.sent, "failed": r.failed,
                                     "next_index": r.state.next_index}


class NotifyingSyncer:
    """The coordinator's sync, then tell the Rollouter which version the engines now serve."""

    def __init__(self, coordinator: Any, rollouter: Any):
        self.coordinator, self.rollouter = coordinator, rollouter

    async def sync(self) -> int:
        version = await self.coordinator.sync()
        await self.rollouter.on_sync.remote(version)
        return version


def run(args: argparse.Namespace) -> int:
    """Run the pipeline described by the launcher's flags; returns the process exit code."""
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    import ray

    from asyncrl.queue import StreamConfig, StreamConsumer
    from asyncrl.rollouter.actor import remote_engine_actor
    from asyncrl.sync import WeightSyncConfig, WeightSyncCoordinator
    from asyncrl.trainer.config import AlgorithmConfig, OptimConfig, TrainerConfig, WorkerConfig
    from asyncrl.net import free_port
    from asyncrl.trainer.ranks import RankGroup
    from asyncrl.trainer.trainer import Trainer

    gpu = args.rollouter_gpus > 0
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    model_path = args.model or _default_model(run_dir)
    tokenizer_pad = _pad_token_id(model_path)
    n_engines = args.rollouter_gpus if gpu else args.engines
    n_ranks = args.trainer_gpus if gpu else args.trainer_ranks
    max_tokens = args.max_tokens or (512 if args.dataset else 6)

    address = args.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        # Every actor reserves one CPU; on a laptop they share the cores (torch uses 1 thread each).
        ray.init(num_cpus=n_engines + n_ranks + 2, include_dashboard=False, log_to_driver=True,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    ranks = consumer = rollouter = metrics = None
    engines: list = []
    try:
        print(f"asyncrl: run dir {run_dir}; model {model_path}; {n_engines} engine(s), {n_ranks} trainer rank(s)",
              flush=True)
        metrics = _start_metrics(args, run_dir)
        engine_cls = remote_engine_actor(num_cpus=1, num_gpus=1 if gpu else 0)
        engines = [engine_cls.remote(kind="vllm" if gpu else "torch", model_path=model_path) for _ in range(n_engines)]
        await asyncio.gather(*(e.ready.remote() for e in engines))

        checkpoint_every = max(1, min(10, args.steps))
        cfg = TrainerConfig(
            worker=WorkerConfig(
                model_path=model_path, pad_token_id=tokenizer_pad, seed=args.seed, micro_batch_size=16,
                engine_kind="vllm" if gpu else "torch",
                algorithm=AlgorithmConfig(temperature=args.temperature),
                optim=OptimConfig(lr=args.lr or (1e-5 if args.model else 2e-3), warmup_steps=0),
            ),
            world_size=n_ranks, gpus_per_rank=1.0 if gpu else 0.0,
            groups_per_batch=args.groups_per_step, trigger_parameter_sync_step=args.sync_every,
            checkpoint_dir=str(run_dir / "checkpoints"), checkpoint_every=checkpoint_every,
        )
        ranks = RankGroup.start_ray(cfg)

        # Groups are acked only once the checkpoint holding their step is written, so the window
        # must cover a checkpoint interval plus what the Rollouter may run ahead.
        per_sync = args.groups_per_step * args.sync_every
        window = args.groups_per_step * checkpoint_every + int((1 + args.staleness_threshold) * per_sync) + 1
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        consumer = StreamConsumer(StreamConfig(endpoint=endpoint, window=window))
        await consumer.start()

        rollout_cfg = RolloutConfig(n=args.n, max_tokens=max_tokens, temperature=args.temperature,
                                    groups_per_sync=per_sync, staleness_threshold=args.staleness_threshold,
                                    max_concurrent=max(4, args.groups_per_step), seed=args.seed)
        rollouter = ray.remote(RolloutWorker).options(num_cpus=1).remote(
            rollout_cfg, engines, endpoint, window, model_path, args.dataset, args.reward, args.seed,
            metrics_endpoint=metrics and metrics.endpoints.publish,
            metrics_interval_s=metrics and metrics.cfg.poll_interval_s or 1.0)
        rollout_ref = rollouter.run.remote()

        coordinator = WeightSyncCoordinator(ranks.workers, engines, WeightSyncConfig())
        source = consumer
        if metrics is not None:  # metrics (#16): time the Trainer's waits, report each step
            from asyncrl.metrics.report import MeteredSource, TrainerReporter

            source = MeteredSource(consumer)
            metrics.reporter = TrainerReporter(metrics.emitter("trainer"), source, coordinator, consumer)
        trainer = Trainer(cfg, ranks, source, NotifyingSyncer(coordinator, rollouter),
                          rollouter_state=lambda: rollouter.feed_state.remote())
        await _train(trainer, args.steps, run_dir, rollout_ref, metrics)
        return 0
    finally:
        if rollouter is not None:
            ray.kill(rollouter)
        if consumer is not None:
            await consumer.close()
        if ranks is not None:
            ranks.close()
        for e in engines:
            ray.kill(e)
        ray.shutdown()
        if metrics is not None:
            metrics.close()


async def _train(trainer: Any, steps: int, run_dir: Path, rollout_ref: Any, metrics: Any = None) -> None:
    """Run the steps and report each: to the metric stream, or (``--no-metrics``) as a printed line."""
    import ray

    rewards: list[float] = []
    t0 = time.monotonic()
    done_at: list[float] = []  # when each step finished
    rollout_task = asyncio.wrap_future(rollout_ref.future())
    # The Rollouter is killed at shutdown; its run() then ends with ActorDiedError, expected.
    rollout_task.add_done_callback(lambda f: f.cancelled() or f.exception())
    for _ in range(steps):
        step_task = asyncio.ensure_future(trainer.train_step())
        done, _ = await asyncio.wait({step_task, rollout_task}, return_when=asyncio.FIRST_COMPLETED)
        if step_task not in done:
            step_task.cancel()
            ray.get(rollout_ref)  # re-raises the Rollouter's failure here, under its own name
            raise RuntimeError("the Rollouter stopped before training finished")
        result = step_task.result()
        m = result.metrics
        rewards.append(m["reward_mean"])
        done_at.append(time.monotonic())
        if metrics is not None:
            metrics.reporter.after_step(result)  # the console sink prints the step's line
            continue
        print(f"step {m['step']:3d}/{steps}  version {m['version']:3d}  reward {m['reward_mean']:.3f}  "
              f"loss {m['loss']:+.4f}  staleness {m['staleness_mean']:.2f}  "
              f"len {m['response_length_mean']:.1f}  {time.monotonic() - t0:.0f}s", flush=True)
    if metrics is not None:
        metrics.wait_recorded(metrics.reporter.emitter)  # the last step's line comes before the summary
    k = max(1, min(5, len(rewards) // 3))
    first, last = float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))
    if len(done_at) > 1:  # after the first step: start-up and first compile excluded
        per_step = (done_at[-1] - done_at[0]) / (len(done_at) - 1)
        print(f"asyncrl: steps 2-{len(done_at)} took {per_step:.3f} s/step", flush=True)
    print(f"asyncrl: mean reward of the first {k} steps {first:.3f} -> last {k} steps {last:.3f}; "
          f"metrics in {run_dir / 'metrics.jsonl'}, checkpoints in {run_dir / 'checkpoints'}", flush=True)


def _start_metrics(args: argparse.Namespace, run_dir: Path):
    """The run's metric stream and sinks (None with ``--no-metrics``)."""
    if args.no_metrics:
        return None
    from asyncrl.metrics.config import MetricsConfig
    from asyncrl.metrics.service import MetricsService

    cfg = MetricsConfig(sinks=args.metrics_sinks, dashboard=args.dashboard)
    return MetricsService(cfg, run_dir, total_steps=args.steps)


def _default_model(run_dir: Path) -> str:
    from asyncrl.models import default_model_path

    print("asyncrl: preparing the tiny warm-started model (cached after the first run)...", flush=True)
    return str(default_model_path())


def _pad_token_id(model_path: str) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
