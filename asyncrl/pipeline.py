"""Build the fully async pipeline on Ray and run it: what ``python -m asyncrl.launch`` does.

::

    EngineActor x E ◄── Rollouter actor ──► StreamProducer ══ZeroMQ══► StreamConsumer (here)
          ▲                                                              │
          └──── WeightSyncCoordinator ◄── every K steps ── Trainer ◄─────┘
                 (pause keep, broadcast, load, resume)       └─► TrainerWorker x T (FSDP2)

The Trainer's driver loop runs in this process, with the stream's consumer; the Rollouter,
the engines and the trainer ranks are Ray actors (separate processes). Metrics go to
``<run_dir>/metrics.jsonl``, checkpoints to ``<run_dir>/checkpoints``, the audit trail of
trained and dropped groups to ``<run_dir>/samples.jsonl``.

Resume (``--resume RUN_DIR``): the ranks load the latest checkpoint (model, optimizer, step,
version, committed set); the engines get those weights (`WeightSyncCoordinator.republish`)
before the Rollouter starts; the coordinator and the Rollouter continue at the restored
version; the Rollouter regenerates, by id, every id it had admitted that the checkpoint does
not hold as trained or dropped, then feeds new ids from ``next_index``.

Stopping: the run's end, Ctrl-C or SIGTERM (`asyncrl.shutdown`) and a failure the Trainer
survives (the Rollouter or an engine died, a group failed closed) all end with a checkpoint;
then the Rollouter is drained, and the stream, the ranks and the engines are closed, in that
order. A trainer rank that died (or a step that failed mid-training) leaves the last checkpoint
as the resume point.
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

import logging

import numpy as np

from asyncrl.rollouter.rollouter import RolloutConfig, Rollouter, RolloutState, encode_prompts

log = logging.getLogger("asyncrl.launch")


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
                 dataset: str | None, reward: str | None, seed: int, resume: dict | None = None):
        """``resume``: ``{"saved": <the checkpoint's rollouter_state>, "committed": <CommittedSet
        JSON>, "dropped": int}`` of a restored Trainer (see `RolloutState.resume`)."""
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
        if resume is None:
            self.state = RolloutState()
        else:
            from asyncrl.types import CommittedSet

            self.state = RolloutState.resume(resume["saved"], CommittedSet.from_json(resume["committed"]),
                                             resume["dropped"], rows=len(prompts))
        self.version = 0
        self.rollouter: Rollouter | None = None
        self._stopped = False

    async def run(self, num_groups: int | None = None) -> dict:
        from asyncrl.queue import StreamConfig, StreamProducer

        producer = StreamProducer(StreamConfig(endpoint=self.endpoint, window=self.window), producer_id="rollouter-0")
        await producer.start()
        self.rollouter = Rollouter(self.cfg, self.engines, producer, self.prompts, self.reward_fn, state=self.state)
        await self.rollouter.on_sync(self.version)  # a sync may have landed before run() started
        if self._stopped:
            await self.rollouter.stop()
        try:
            await self.rollouter.run(num_groups)
        finally:
            await producer.close()
        return self.progress()

    async def stop(self) -> dict:
        """Drain: no new prompts, in-flight groups cancelled and aborted on the engines; `run` returns."""
        self._stopped = True
        if self.rollouter is not None:
            await self.rollouter.stop()
        return self.progress()

    async def on_sync(self, version: int) -> None:
        self.version = version
        if self.rollouter is not None:
            await self.rollouter.on_sync(version)

    def feed_state(self) -> dict:
        """The feed position and what is in flight, for the Trainer's checkpoint (``rollouter_state``)."""
        if self.rollouter is not None:
            return self.rollouter.snapshot()
        st = self.state
        return {"epoch": st.epoch, "next_index": st.next_index, "position": st.position}

    def progress(self) -> dict:
        r = self.rollouter
        return {} if r is None else {"admitted": r.admitted, "sent": r.sent, "failed": r.failed,
                                     "next_index": r.state.next_index}


class NotifyingSyncer:
    """The coordinator's sync, then tell the Rollouter which version the engines now serve.

    An engine that died is dropped by the coordinator; while live engines took the new weights
    the run goes on with them (the Rollouter stops using a dead engine on its own)."""

    def __init__(self, coordinator: Any, rollouter: Any):
        self.coordinator, self.rollouter = coordinator, rollouter

    async def sync(self) -> int:
        from asyncrl.sync.sender import WeightSyncError

        try:
            version = await self.coordinator.sync()
        except WeightSyncError as e:
            c = self.coordinator
            if not c.engines or not set(c.last.failed) <= set(c.dead) or c.version != c.last.version:
                raise
            log.warning("weight sync to version %d went on without dead engines: %s", c.version, e)
            print(f"asyncrl: engine(s) {', '.join(c.last.failed)} died; going on with {len(c.engines)}", flush=True)
            version = c.version
        await self.rollouter.on_sync.remote(version)
        return version


class FeedState:
    """The Rollouter's feed state for each checkpoint; if the Rollouter cannot answer (it died),
    the last answer it gave (`RolloutState.resume` moves a stale position past the committed ids)."""

    def __init__(self, rollouter: Any, last: dict | None = None, timeout_s: float = 60.0):
        self.rollouter, self.last, self.timeout_s = rollouter, dict(last or {}), timeout_s

    async def __call__(self) -> dict:
        try:
            self.last = await asyncio.wait_for(self.rollouter.feed_state.remote(), self.timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure to answer leaves the last known state
            log.warning("the Rollouter did not give its feed state (%s: %s); the checkpoint keeps its last one",
                        type(e).__name__, e)
            return {**self.last, "stale": True}
        return self.last


def run(args: argparse.Namespace) -> int:
    """Run the pipeline described by the launcher's flags; returns the process exit code."""
    return asyncio.run(_run(args))


@dataclasses.dataclass
class Processes:
    """What `_run` started; `close` stops it in order: Rollouter (drained), stream, ranks, engines."""

    engines: list = dataclasses.field(default_factory=list)
    ranks: Any = None
    consumer: Any = None
    rollouter: Any = None

    async def close(self, *, drain: bool, timeout_s: float = 30.0) -> None:
        import ray

        if self.rollouter is not None:
            if drain:
                try:
                    await asyncio.wait_for(self.rollouter.stop.remote(), timeout_s)
                except Exception as e:  # noqa: BLE001 - a dead or wedged Rollouter is killed below
                    log.warning("the Rollouter did not drain (%s: %s)", type(e).__name__, e)
            ray.kill(self.rollouter)
        if self.consumer is not None:
            await self.consumer.close()
        if self.ranks is not None:
            self.ranks.close()
        if drain and self.engines:
            await asyncio.wait([asyncio.ensure_future(_quietly(e.close.remote())) for e in self.engines],
                               timeout=timeout_s)
        for e in self.engines:
            ray.kill(e)


async def _quietly(ref) -> None:
    try:
        await ref
    except Exception:  # noqa: BLE001 - closing an engine that already died
        pass


async def _run(args: argparse.Namespace) -> int:
    import ray

    from asyncrl.queue import StreamConfig, StreamConsumer
    from asyncrl.rollouter.actor import remote_engine_actor
    from asyncrl.shutdown import EXIT_INTERRUPTED, GracefulStop
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
    procs = Processes()
    trainer = None

    def on_stop() -> None:
        if trainer is not None:
            trainer.request_stop()
        else:
            main.cancel()  # still starting: nothing to checkpoint, stop starting

    main = asyncio.current_task()
    stop = GracefulStop(on_stop)
    try:
        with stop:
            print(f"asyncrl: run dir {run_dir}; model {model_path}; {n_engines} engine(s), {n_ranks} trainer rank(s)",
                  flush=True)
            engine_cls = remote_engine_actor(num_cpus=1, num_gpus=1 if gpu else 0)
            procs.engines = [engine_cls.remote(kind="vllm" if gpu else "torch", model_path=model_path)
                             for _ in range(n_engines)]
            await asyncio.gather(*(e.ready.remote() for e in procs.engines))

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
                samples_path=str(run_dir / "samples.jsonl"),
            )
            procs.ranks = RankGroup.start_ray(cfg)
            trainer = Trainer(cfg, procs.ranks, source=None)
            resume = None
            if await trainer.restore():
                resume = {"saved": trainer.restored_rollouter_state, "committed": trainer.committed.to_json(),
                          "dropped": trainer.dropped}
                print(f"asyncrl: resumed at step {trainer.step}, version {trainer.version}; "
                      f"{len(trainer.committed)} groups done", flush=True)

            # Groups are acked only once the checkpoint holding their step is written, so the window
            # must cover a checkpoint interval plus what the Rollouter may run ahead.
            per_sync = args.groups_per_step * args.sync_every
            window = args.groups_per_step * checkpoint_every + int((1 + args.staleness_threshold) * per_sync) + 1
            endpoint = f"tcp://127.0.0.1:{free_port()}"
            procs.consumer = StreamConsumer(StreamConfig(endpoint=endpoint, window=window), committed=trainer.committed)
            await procs.consumer.start()

            rollout_cfg = RolloutConfig(n=args.n, max_tokens=max_tokens, temperature=args.temperature,
                                        groups_per_sync=per_sync, staleness_threshold=args.staleness_threshold,
                                        max_concurrent=max(4, args.groups_per_step), seed=args.seed)
            procs.rollouter = ray.remote(RolloutWorker).options(num_cpus=1).remote(
                rollout_cfg, procs.engines, endpoint, window, model_path, args.dataset, args.reward, args.seed, resume)

            coordinator = WeightSyncCoordinator(procs.ranks.workers, procs.engines, WeightSyncConfig(),
                                                version=trainer.version)
            if resume is not None:
                await coordinator.republish()  # the engines serve the restored weights before they generate
            await procs.rollouter.on_sync.remote(trainer.version)
            rollout_ref = procs.rollouter.run.remote()
            trainer.source = procs.consumer
            trainer.syncer = NotifyingSyncer(coordinator, procs.rollouter)
            trainer.rollouter_state = FeedState(procs.rollouter, last=trainer.restored_rollouter_state)
            await _train(trainer, args.steps, run_dir, rollout_ref)
            if stop.requested:
                print(f"asyncrl: stopped cleanly at step {trainer.step} ({stop.requested}); "
                      f"resume with --resume {run_dir}", flush=True)
        return 0
    except asyncio.CancelledError:
        if stop.hard is not None:
            return EXIT_INTERRUPTED
        if stop.requested is not None:
            print(f"asyncrl: stopped while starting ({stop.requested})", flush=True)
            return 0
        raise
    finally:
        await procs.close(drain=stop.hard is None)
        ray.shutdown()


async def _train(trainer: Any, steps: int, run_dir: Path, rollout_ref: Any) -> None:
    """Train until step ``steps`` (counting restored ones), print a line and append metrics per step.

    Ends with a checkpoint whenever the trainer can write one: at the last step, after a stop
    request, and after a failure outside the ranks' training (re-raised after the checkpoint).
    """
    from asyncrl.trainer.trainer import StepAbandoned

    rewards: list[float] = []
    t0 = time.monotonic()
    rollout_task = asyncio.wrap_future(rollout_ref.future())
    rollout_task.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen below, under its own name
    try:
        with open(run_dir / "metrics.jsonl", "a") as out:
            while trainer.step < steps and not trainer.stopping:
                step_task = asyncio.ensure_future(trainer.train_step())
                done, _ = await asyncio.wait({step_task, rollout_task}, return_when=asyncio.FIRST_COMPLETED)
                if step_task not in done:
                    # The Rollouter ended first: its failure is the run's; the step in hand still
                    # ends cleanly (abandoned while collecting, or finished) so it can be checkpointed.
                    trainer.request_stop()
                    await asyncio.gather(step_task, return_exceptions=True)
                    rollout_task.result()  # re-raises the Rollouter's failure, under its own name
                    raise RuntimeError("the Rollouter stopped before training finished")
                try:
                    m = step_task.result().metrics
                except StepAbandoned:
                    break
                m["time_s"] = round(time.monotonic() - t0, 2)
                out.write(json.dumps(m) + "\n")
                out.flush()
                rewards.append(m["reward_mean"])
                print(f"step {m['step']:3d}/{steps}  version {m['version']:3d}  reward {m['reward_mean']:.3f}  "
                      f"loss {m['loss']:+.4f}  staleness {m['staleness_mean']:.2f}  "
                      f"len {m['response_length_mean']:.1f}  {m['time_s']:.0f}s", flush=True)
    except Exception as e:
        await _checkpoint_after_failure(trainer, e, run_dir)
        raise
    await trainer.finish()
    if rewards:
        k = max(1, min(5, len(rewards) // 3))
        first, last = float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))
        print(f"asyncrl: mean reward of the first {k} steps {first:.3f} -> last {k} steps {last:.3f}; "
              f"metrics in {run_dir / 'metrics.jsonl'}, checkpoints in {run_dir / 'checkpoints'}", flush=True)


async def _checkpoint_after_failure(trainer: Any, error: Exception, run_dir: Path) -> None:
    """Make what the Trainer did durable before the run stops on ``error`` (if the ranks allow)."""
    where = f"resume with --resume {run_dir}"
    if trainer.broken:
        print(f"asyncrl: stopping on {type(error).__name__}; no checkpoint ({trainer.broken}); {where} from the "
              f"last one", flush=True)
        return
    try:
        await trainer.finish()
    except Exception as e:  # noqa: BLE001 - the original failure is what the run reports
        print(f"asyncrl: stopping on {type(error).__name__}; the checkpoint failed too ({type(e).__name__}: {e}); "
              f"{where} from the last one", flush=True)
        return
    print(f"asyncrl: stopping on {type(error).__name__}: {error}\nasyncrl: checkpoint at step {trainer.step} written; "
          f"{where}", flush=True)


def _default_model(run_dir: Path) -> str:
    from asyncrl.models import default_model_path

    print("asyncrl: preparing the tiny warm-started model (cached after the first run)...", flush=True)
    return str(default_model_path())


def _pad_token_id(model_path: str) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
