"""Start the run's processes on their planned places, and close them: the launcher's *start* and *close*.

::

    EngineActor x R ◄── RolloutWorker (Rollouter) ──► StreamProducer ══ZeroMQ══► StreamConsumer (here)
          ▲                                                                       │
          └──── WeightSyncCoordinator ◄── every K steps ── Trainer (here) ◄───────┘
                 (pause keep, broadcast, load, resume)         └─► TrainerWorker x T (FSDP2)

The Trainer's driver loop runs in the launcher's process, with the stream's consumer; the
Rollouter, the engines and the trainer ranks are Ray actors in the placement groups of the
`asyncrl.placement.Plan`. Every wait for a process to be ready has a deadline naming its setting.

Resume: when ``<run_dir>/checkpoints`` holds a checkpoint, the ranks load it (model, optimizer,
step, version, committed set); the stream's consumer starts from that committed set; the
engines get the restored weights (`WeightSyncCoordinator.republish`) before the Rollouter
starts; the coordinator and the Rollouter continue at the restored version (one more when the
run stopped in a weight sync: `Trainer.catch_up_sync` runs that sync instead); the Rollouter
regenerates, by id, every id it had admitted that the checkpoint does not hold as trained or
dropped, then feeds new ids from ``next_index`` (`RolloutState.resume`).

Close: the Rollouter is drained (no new prompts, in-flight requests aborted), then the stream,
the ranks and the engines are closed, in that order; a hard stop kills them all at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("asyncrl.launch")


@dataclass
class Processes:
    """Handles of everything `start` started; `close` stops them in reverse order."""

    plan: Any
    engines: list
    ranks: Any = None
    consumer: Any = None
    rollouter: Any = None
    aggregator: Any = None
    trainer: Any = None
    rollout_run: Any = None
    """The Rollouter's ``run`` call (an ObjectRef); it fails if the Rollouter does."""
    metrics: Any = None
    """The run's `asyncrl.metrics.MetricsService` (None when ``metrics.enabled`` is false)."""
    dashboard: Any = None
    """The live `asyncrl.dashboard.server.DashboardServer` on the metric stream (``metrics.dashboard``)."""

    async def validate(self, step: int) -> dict[str, float]:
        """Score the validation file with the current weights (``val/`` metrics; {} without one)."""
        return await self.rollouter.validate.remote(step)

    async def rollout_summary(self) -> str:
        """One line: groups the Rollouter admitted, sent and replayed from skip dumps, engine requests served."""
        import json

        progress = await self.rollouter.progress.remote()
        stats = await asyncio.gather(*(e.stats.remote() for e in self.engines), return_exceptions=True)
        requests = sum(s.get("requests", 0) for s in stats if isinstance(s, dict))  # a dead replica: none
        skip = "".join(f"; skip.{role} {json.dumps(c, sort_keys=True)}" for role, c in progress.get("skip", {}).items())
        return (f"asyncrl: rollouter admitted {progress.get('admitted', 0)} groups, sent {progress.get('sent', 0)}, "
                f"replayed {progress.get('replayed', 0)} from skip dumps; engines served {requests} requests{skip}")

    async def close(self, *, drain: bool = True, timeout_s: float = 30.0) -> None:
        """Stop everything: drain the Rollouter, close the stream, the ranks, the engines (in that
        order, each under ``timeout_s``); ``drain=False`` kills them at once."""
        import ray

        if self.rollouter is not None:
            if drain:
                try:
                    await asyncio.wait_for(self.rollouter.stop.remote(), timeout_s)
                except Exception as e:  # noqa: BLE001 - a dead or wedged Rollouter is killed below
                    log.warning("the Rollouter did not drain (%s: %s)", type(e).__name__, e)
            ray.kill(self.rollouter)
        if self.aggregator is not None:
            ray.kill(self.aggregator)
        if self.consumer is not None:
            await self.consumer.close()
        if self.ranks is not None:
            self.ranks.close()
        if drain and self.engines:
            await asyncio.wait([asyncio.ensure_future(_quietly(e.close.remote())) for e in self.engines],
                               timeout=timeout_s)
        for e in self.engines:
            ray.kill(e)
        self.plan.release()
        if self.metrics is not None:
            self.metrics.close()
        if self.dashboard is not None:
            self.dashboard.close()


async def _quietly(ref) -> None:
    try:
        await ref
    except Exception:  # noqa: BLE001 - closing an engine that already died
        pass


class EngineRestarter:
    """Starts a dead engine replica again in its own placement bundle (``max_restarts`` times each,
    ``backoff_s`` x k before restart k); `NotifyingSyncer` adds it back at the next sync.

    A start that fails (the new actor dies, or ``start_engine`` raises) uses up a restart like a
    death does: the replica, still dead to the coordinator, is started again at the next
    `notice`, and past ``max_restarts`` it is left out with a line naming it and why."""

    def __init__(self, start_engine: Callable[[int], Any], max_restarts: int, backoff_s: float):
        self.start_engine, self.max_restarts, self.backoff_s = start_engine, max_restarts, backoff_s
        self.restarts: dict[int, int] = {}
        self.starting: dict[int, asyncio.Task] = {}
        self.died_at: dict[int, float] = {}
        self.left_out: set[int] = set()
        self.start_errors: dict[int, BaseException] = {}
        """Replica -> why its last start failed (cleared when a start succeeds)."""

    def notice(self, dead: dict[str, str]) -> None:
        """Start again every replica in ``dead`` (the coordinator's) not yet being started."""
        from asyncrl.sync.coordinator import engine_index

        for name, why in dead.items():
            i = engine_index(name)
            if i is None or i in self.starting or i in self.left_out:
                continue
            failed_start = self.start_errors.get(i)
            what = f"did not start again ({failed_start!r})" if failed_start is not None else f"died ({why})"
            k = self.restarts.get(i, 0) + 1
            if k > self.max_restarts:
                self.left_out.add(i)
                print(f"asyncrl: {name} {what}; left out: engine.max_restarts={self.max_restarts} used",
                      flush=True)
                continue
            self.restarts[i] = k
            if failed_start is None:  # (a retry keeps the time it was first found dead)
                self.died_at[i] = time.monotonic()
            print(f"asyncrl: {name} {what}; starting it again ({k}/{self.max_restarts}) in "
                  f"{self.backoff_s * k:g} s", flush=True)
            self.starting[i] = asyncio.ensure_future(self._start(i, self.backoff_s * k))

    async def _start(self, i: int, wait: float) -> Any:
        await asyncio.sleep(wait)
        handle = self.start_engine(i)
        await handle.ready.remote()
        return handle

    def ready(self) -> dict[int, Any]:
        """Replicas started and ready since the last call (a failed start is noticed again later)."""
        out = {}
        for i, task in list(self.starting.items()):
            if not task.done():
                continue
            del self.starting[i]
            if task.exception() is not None:
                self.start_errors[i] = task.exception()
                log.warning("engine[%d] did not start again: %r", i, task.exception())
                print(f"asyncrl: engine[{i}] did not start again ({task.exception()!r})", flush=True)
                continue
            self.start_errors.pop(i, None)
            out[i] = task.result()
        return out


class NotifyingSyncer:
    """Tell the Rollouter a sync pauses the engines, run the coordinator's sync, then tell it
    which version the engines now serve.

    An engine that died is dropped by the coordinator; while live engines took the new weights
    the run goes on with them (the Rollouter stops using a dead engine on its own). With a
    `EngineRestarter`, a dead replica is started again and, once ready, joins the next sync: it
    gets that sync's weights before the Rollouter sends it a request."""

    def __init__(self, coordinator: Any, rollouter: Any, restarter: EngineRestarter | None = None,
                 on_engine: Callable[[int, Any], None] | None = None):
        self.coordinator, self.rollouter, self.restarter, self.on_engine = coordinator, rollouter, restarter, on_engine

    async def sync(self) -> int:
        from asyncrl.sync import WeightSyncError
        from asyncrl.sync.coordinator import engine_name

        c = self.coordinator
        joining = self.restarter.ready() if self.restarter else {}
        for i, handle in joining.items():
            c.add_engine(engine_name(i), handle)
        await self.rollouter.on_pause.remote()
        try:
            version = await c.sync()
        except WeightSyncError as e:
            if not c.engines or not set(c.last.failed) <= set(c.dead) or c.version != c.last.version:
                raise
            log.warning("weight sync to version %d went on without dead engines: %s", c.version, e)
            print(f"asyncrl: engine(s) {', '.join(c.last.failed)} died; going on with {len(c.engines)}", flush=True)
            version = c.version
        for i, handle in joining.items():
            if engine_name(i) in c.engines:  # it took this sync's weights: it serves from now on
                if self.on_engine is not None:
                    self.on_engine(i, handle)
                await self.rollouter.replace_engine.remote(i, handle)
                print(f"asyncrl: engine[{i}] serves again at version {version}, "
                      f"{time.monotonic() - self.restarter.died_at[i]:.1f} s after it was found dead", flush=True)
        await self.rollouter.on_sync.remote(version)
        if self.restarter is not None:
            self.restarter.notice(c.dead)
        return version


class FeedState:
    """The Rollouter's feed state for each checkpoint; if the Rollouter cannot answer (it died),
    the last answer it gave, marked stale (`RolloutState.resume` moves a stale position past the
    committed ids)."""

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


async def start(cfg, plan, run_dir: Path) -> Processes:
    """Reserve the plan's placement groups and start engines, ranks, stream and Rollouter on them."""
    import ray

    from asyncrl.queue import StreamConsumer
    from asyncrl.rollouter.actor import remote_engine_actor
    from asyncrl.rollouter.aggregator import remote_aggregator_actor
    from asyncrl.rollouter.worker import DataSpec, RolloutWorker
    from asyncrl.skip.config import absolute_dump_dirs
    from asyncrl.sync import WeightSyncCoordinator
    from asyncrl.trainer.ranks import RankGroup
    from asyncrl.trainer.trainer import Trainer

    model_path = cfg.model_path
    print(f"asyncrl: run dir {run_dir}; model {model_path}; {cfg.engine_replicas} engine replica(s), "
          f"{cfg.trainer_world_size} trainer rank(s)", flush=True)
    print(plan.describe(), flush=True)
    plan.reserve()
    procs = Processes(plan=plan, engines=[])
    try:
        if cfg.metrics.enabled:  # metrics (#16): the run's metric stream, its sinks, the dashboard
            from asyncrl.metrics.service import MetricsService

            procs.metrics = MetricsService(cfg.metrics, run_dir)
            if cfg.metrics.dashboard:
                from asyncrl.dashboard.server import DashboardServer, StreamFeed

                procs.dashboard = DashboardServer(StreamFeed(procs.metrics.endpoints.subscribe), host=cfg.metrics.host,
                                                  port=cfg.metrics.dashboard_port, title=run_dir.name)
                print(f"asyncrl: live dashboard at {procs.dashboard.url}", flush=True)
        kind = cfg.engine_kind
        procs.engines = [remote_engine_actor(**plan.options(slot)).remote(kind=kind, **cfg.engine_kwargs(model_path))
                         for slot in plan.engines]
        engines_ready = [e.ready.remote() for e in procs.engines]  # they start while the ranks do

        net = addresses(cfg, plan)
        pad_id, eos_id = _special_token_ids(model_path)
        tcfg = cfg.trainer_config(model_path=model_path, pad_token_id=pad_id, eos_token_id=eos_id,
                                  checkpoint_dir=str(run_dir / "checkpoints"), samples_path=str(run_dir / "samples.jsonl"),
                                  transcripts_path=str(run_dir / "transcripts.jsonl") if cfg.rollout.agent.enabled else None)
        procs.ranks = RankGroup.start_ray(tcfg, actor_options=[plan.options(s) for s in plan.ranks],
                                          across_nodes=net.ranks_across_nodes)
        await _ready(engines_ready, plan.ready_timeout_s, "engine replicas")
        procs.trainer = trainer = Trainer(tcfg, procs.ranks, source=None)
        resume = None
        if await trainer.restore():
            resume = {"saved": trainer.restored_rollouter_state, "committed": trainer.committed.to_json(),
                      "dropped": trainer.dropped}
            partials = sum(len(r) for r in trainer.restored_rollouter_state.get("partials", {}).values())
            print(f"asyncrl: resumed at step {trainer.step}, version {trainer.version}; "
                  f"{len(trainer.committed)} groups done"
                  + (f"; {partials} truncated responses go on from their saved parts" if partials else ""),
                  flush=True)

        procs.consumer = StreamConsumer(net.consumer_stream, committed=trainer.committed)
        await procs.consumer.start()
        print(f"asyncrl: sample stream on {procs.consumer.endpoint}"
              f"{' (CURVE: authenticated, encrypted)' if net.curve else ' (loopback)'}", flush=True)
        # Producers get the endpoint the consumer bound and the keys without the server's secret.
        stream = dataclasses.replace(net.consumer_stream, endpoint=procs.consumer.endpoint,
                                     curve=net.curve.for_producer() if net.curve else None)

        partial = cfg.partial_rollout
        if partial.by_count:
            # Sync mode's rounds end by count (the Rollouter sets each round's threshold). Async
            # mode's end at the sync, inside the engines (the coordinator's clear_cache below).
            threshold = partial.resolved_threshold(cfg.rollout.groups_per_sync, cfg.rollout.n)
            procs.aggregator = remote_aggregator_actor().remote(procs.engines, threshold)
        data = DataSpec(train=cfg.data.train, val=cfg.data.val, reward=cfg.data.reward, seed=cfg.seed,
                        long_tail=cfg.data.long_tail, task=cfg.data.task)
        procs.rollouter = ray.remote(RolloutWorker).options(**plan.options(plan.rollouter)).remote(
            cfg.rollout, procs.engines, stream, model_path, data, resume,
            metrics_endpoint=procs.metrics.endpoints.publish if procs.metrics else None,
            metrics_interval_s=cfg.metrics.poll_interval_s, skip=absolute_dump_dirs(cfg.skip.skip_config()),
            partial=partial, aggregator=procs.aggregator)
        await _ready([procs.rollouter.ready.remote()], plan.ready_timeout_s, "Rollouter (tokenizer and dataset)")

        coordinator = WeightSyncCoordinator(procs.ranks.workers, procs.engines, net.weight_sync,
                                            version=trainer.version, clear_cache=partial.at_sync,
                                            rpc=cfg.rollout.engine_calls == "zmq")
        # The engines serve the restored weights before they generate: the sync the restored run
        # stopped in (its version counts), else the restored version again.
        if resume is not None and not await trainer.catch_up_sync(coordinator):
            await coordinator.republish()
        await procs.rollouter.on_sync.remote(trainer.version)
        procs.rollout_run = procs.rollouter.run.remote()
        source = procs.consumer
        if procs.metrics is not None:  # metrics (#16): time the Trainer's waits, report each step
            from asyncrl.metrics.report import MeteredSource, TrainerReporter

            source = MeteredSource(procs.consumer)
            procs.metrics.reporter = TrainerReporter(procs.metrics.emitter("trainer"), source, coordinator,
                                                     procs.consumer)
        trainer.source = source
        def start_engine(i: int):
            return remote_engine_actor(**plan.options(plan.engines[i])).remote(kind=kind, **cfg.engine_kwargs(model_path))

        def on_engine(i: int, handle) -> None:
            procs.engines[i] = handle  # closed with the others

        restarter = EngineRestarter(start_engine, cfg.engine.max_restarts, cfg.engine.restart_backoff_s)
        trainer.syncer = NotifyingSyncer(coordinator, procs.rollouter, restarter, on_engine)
        trainer.rollouter_state = FeedState(procs.rollouter, last=trainer.restored_rollouter_state)
        trainer.on_dropped = lambda ids: procs.rollouter.on_dropped.remote(ids)
        print(f"asyncrl: mode {cfg.mode}" + (", partial rollout" if partial.enable else ""), flush=True)
        return procs
    except TimeoutError as e:  # a process that does not come up: say where each one waits
        where = where_they_wait(run_dir, f"start-up: {e}")
        await procs.close(drain=False)
        raise TimeoutError(f"{e}; {where}") from None
    except BaseException:
        await procs.close(drain=False)
        raise


def where_they_wait(run_dir: Path, reason: str) -> str:
    """The run's processes' stacks into ``run_dir/hang-<time>.txt`` (`asyncrl.hang.dump_stacks`);
    one line naming the file and the call each process (the launcher left out) waits in."""
    from asyncrl.hang import dump_stacks

    try:
        path, lines = dump_stacks(run_dir, reason=reason)
    except Exception as e:  # noqa: BLE001 - naming the wait must not hide the timeout itself
        return f"(their stacks could not be taken: {type(e).__name__}: {e})"
    others = [line for line in lines if not line.startswith("launcher ")]
    if not others:  # not started yet, or not under the launcher (a cluster it joined)
        return f"stacks in {path}: no process of the run answered (on a joined cluster: `ray stack` on its nodes)"
    return f"stacks in {path}: " + "; ".join(others)


@dataclass
class Addresses:
    """How the processes reach each other: loopback on one node, routable addresses across nodes."""

    consumer_stream: Any
    """The consumer's StreamConfig: the endpoint to bind (port ``*``: taken at bind) and CURVE keys."""
    curve: Any
    """The run's CurveKeys (on loopback too: a local process outside the run must not deliver groups)."""
    ranks_across_nodes: bool
    """Trainer ranks on several nodes: rank 0 binds the world's store on its node's address."""
    weight_sync: Any


def addresses(cfg, plan) -> Addresses:
    """Loopback when every process (the launcher's Trainer loop included) shares one node; else
    the nodes' routable addresses, ports bound on those nodes, and an authenticated stream."""
    import ray

    from asyncrl.queue.security import make_curve_keys

    here = ray.get_runtime_context().get_node_id()
    slots = [plan.rollouter, *plan.engines, *plan.ranks]
    one_node = all(s.node.node_id == here for s in slots)
    ranks_across_nodes = len({s.node.node_id for s in plan.ranks}) > 1
    curve = make_curve_keys()  # every run: loopback admits any local user's process (docs/security.md)
    if one_node:
        return Addresses(dataclasses.replace(cfg.stream, endpoint="tcp://127.0.0.1:*", curve=curve), curve,
                         ranks_across_nodes, cfg.weight_sync_config())
    stream = dataclasses.replace(cfg.stream, endpoint=f"tcp://{ray.util.get_node_ip_address()}:*", curve=curve)
    sync = cfg.weight_sync_config()  # its backend follows the engines' kind
    if sync.master_addr in ("127.0.0.1", "localhost"):
        sync = dataclasses.replace(sync, master_addr="auto")  # trainer rank 0's node address, port bound there
    return Addresses(stream, curve, ranks_across_nodes, sync)


async def _ready(refs: list, timeout_s: float, what: str) -> list:
    try:
        return await asyncio.wait_for(asyncio.gather(*refs), timeout_s)
    except TimeoutError:
        raise TimeoutError(f"{what} not ready within placement.ready_timeout_s={timeout_s}") from None


def _special_token_ids(model_path: str) -> tuple[int, int | None]:
    """The tokenizer's pad id (its EOS when it has none) and its EOS id."""
    from asyncrl.models import load_tokenizer

    tok = load_tokenizer(model_path)
    eos = tok.eos_token_id
    return int(tok.pad_token_id if tok.pad_token_id is not None else eos), None if eos is None else int(eos)


def _pad_token_id(model_path: str) -> int:
    return _special_token_ids(model_path)[0]
