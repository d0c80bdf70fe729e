"""One starter per part of the run (`asyncrl.processes.start` calls them in order).

Each starter starts its part and, in the same place, registers that part's close on the run's
`contextlib.AsyncExitStack` (``procs.stack``): closing the stack closes the parts in the reverse
order of their start, by construction. A close reads ``procs.drain`` and ``procs.timeout_s``
(set by `Processes.close`): a drained close asks first (the Rollouter stops feeding, the engines
close), a hard one kills at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("asyncrl.launch")


def start_metrics(procs, cfg, run_dir: Path) -> None:
    """The run's metric stream and its sinks, then the live dashboard on it (``metrics``; #16)."""
    if not cfg.metrics.enabled:
        return
    from asyncrl.metrics.service import MetricsService

    procs.metrics = MetricsService(cfg.metrics, run_dir)
    procs.stack.callback(procs.metrics.close)
    if cfg.metrics.dashboard:
        from asyncrl.dashboard.server import DashboardServer, StreamFeed

        procs.dashboard = DashboardServer(StreamFeed(procs.metrics.endpoints.subscribe), host=cfg.metrics.host,
                                          port=cfg.metrics.dashboard_port, title=run_dir.name)
        procs.stack.callback(procs.dashboard.close)
        print(f"asyncrl: live dashboard at {procs.dashboard.url}", flush=True)


def engine_starter(cfg, plan):
    """``start(i)``: a new engine actor in replica ``i``'s placement bundle (at start and restarts)."""
    from asyncrl.rollouter.actor import remote_engine_actor

    kind, model_path = cfg.engine_kind, cfg.model_path

    def start(i: int):
        return remote_engine_actor(**plan.options(plan.engines[i])).remote(kind=kind, **cfg.engine_kwargs(model_path))
    return start


def start_engines(procs, cfg, plan) -> list:
    """The engine replicas (their ``ready`` calls: they load while the ranks start)."""
    procs.stack.push_async_callback(_close_engines, procs)
    start = engine_starter(cfg, plan)
    for i in range(len(plan.engines)):
        procs.engines.append(start(i))
    return [e.ready.remote() for e in procs.engines]


async def _close_engines(procs) -> None:
    import ray

    if procs.drain and procs.engines:
        await asyncio.wait([asyncio.ensure_future(_quietly(e.close.remote())) for e in procs.engines],
                           timeout=procs.timeout_s)
    for e in procs.engines:
        ray.kill(e)


async def _quietly(ref) -> None:
    try:
        await ref
    except Exception:  # noqa: BLE001 - closing an engine that already died
        pass


def start_ranks(procs, tcfg, plan, across_nodes: bool) -> None:
    """The trainer ranks (FSDP2), one per planned slot."""
    from asyncrl.trainer.ranks import RankGroup

    procs.ranks = RankGroup.start_ray(tcfg, actor_options=[plan.options(s) for s in plan.ranks],
                                      across_nodes=across_nodes)
    procs.stack.callback(procs.ranks.close)


async def restore(procs, tcfg):
    """The latest checkpoint loaded into the ranks; its `TrainerState` (None: a fresh run)."""
    from asyncrl.trainer.checkpoint import load_latest
    from asyncrl.types import CommittedSet

    state = await load_latest(tcfg, procs.ranks)
    if state is not None:
        partials = sum(len(r) for r in state.rollouter_state.get("partials", {}).values())
        print(f"asyncrl: resumed at step {state.step}, version {state.version}; "
              f"{len(CommittedSet.from_json(state.committed))} groups done"
              + (f"; {partials} truncated responses go on from their saved parts" if partials else ""),
              flush=True)
    return state


async def start_stream(procs, net, state):
    """The sample stream's consumer, from the restored committed set; the producers' StreamConfig."""
    from asyncrl.queue import StreamConsumer
    from asyncrl.types import CommittedSet

    committed = CommittedSet.from_json(state.committed) if state is not None else CommittedSet()
    procs.consumer = StreamConsumer(net.consumer_stream, committed=committed)
    procs.stack.push_async_callback(procs.consumer.close)
    await procs.consumer.start()
    print(f"asyncrl: sample stream on {procs.consumer.endpoint}"
          f"{' (CURVE: authenticated, encrypted)' if net.curve else ' (loopback)'}", flush=True)
    # Producers get the endpoint the consumer bound and the keys without the server's secret.
    return dataclasses.replace(net.consumer_stream, endpoint=procs.consumer.endpoint,
                               curve=net.curve.for_producer() if net.curve else None)


def start_aggregator(procs, cfg) -> None:
    """Sync mode's rounds end by count (the Rollouter sets each round's threshold); async mode's
    end at the sync, inside the engines (`start_sync`'s ``clear_cache``): no aggregator."""
    from asyncrl.rollouter.aggregator import remote_aggregator_actor

    partial = cfg.partial_rollout
    if partial.by_count:
        threshold = partial.resolved_threshold(cfg.groups_per_sync, cfg.rollout.n)
        procs.aggregator = remote_aggregator_actor().remote(procs.engines, threshold)
        procs.stack.push_async_callback(_drain_then_kill, procs, procs.aggregator, "close", "aggregator")  # its sockets


async def _drain_then_kill(procs, actor, method: str, what: str) -> None:
    """On a drained close, call ``actor.method`` (bounded by the close timeout), then kill the actor
    whatever came of it: a dead or wedged one is killed all the same."""
    import ray

    if procs.drain:
        try:
            await asyncio.wait_for(getattr(actor, method).remote(), procs.timeout_s)
        except Exception as e:  # noqa: BLE001 - killed below
            log.warning("the %s did not %s (%s: %s)", what, method, type(e).__name__, e)
    ray.kill(actor)


async def start_rollouter(procs, cfg, plan, stream, state, ready) -> None:
    """The Rollouter actor (tokenizer, dataset, skip dumps), resumed from ``state``'s feed state."""
    import ray

    from asyncrl.rollouter.worker import DataSpec, RolloutWorker
    from asyncrl.skip.config import absolute_dump_dirs
    from asyncrl.types import CommittedSet

    resume = None
    if state is not None:
        resume = {"saved": state.rollouter_state, "committed": CommittedSet.from_json(state.committed).to_json(),
                  "dropped": state.dropped}
    data = DataSpec(train=cfg.data.train, val=cfg.data.val, reward=cfg.data.reward, seed=cfg.seed,
                    long_tail=cfg.data.long_tail, task=cfg.data.task)
    procs.rollouter = ray.remote(RolloutWorker).options(**plan.options(plan.rollouter)).remote(
        cfg.rollout_config(), procs.engines, stream, cfg.model_path, data, resume,
        metrics_endpoint=procs.metrics.endpoints.publish if procs.metrics else None,
        metrics_interval_s=cfg.metrics.poll_interval_s, skip=absolute_dump_dirs(cfg.skip.skip_config()),
        partial=cfg.partial_rollout, aggregator=procs.aggregator)
    procs.stack.push_async_callback(_drain_then_kill, procs, procs.rollouter, "stop", "Rollouter")  # no new prompts, in-flight aborted
    await ready([procs.rollouter.ready.remote()], plan.ready_timeout_s, "Rollouter (tokenizer and dataset)")




async def start_sync(procs, cfg, net, state):
    """The weight-sync coordinator; the engines serve the restored weights before they generate
    (the sync the restored run stopped in: its version counts; else the restored version again).
    Returns it and ``state`` as the Trainer goes on from it (that sync done)."""
    from asyncrl.sync import WeightSyncCoordinator

    coordinator = WeightSyncCoordinator(procs.ranks.workers, procs.engines, net.weight_sync,
                                        version=state.version if state is not None else 0,
                                        clear_cache=cfg.partial_rollout.at_sync,
                                        rpc=cfg.rollout.engine_calls == "zmq")
    procs.stack.callback(coordinator.close)
    if state is not None:
        if state.sync_due:  # (what `Trainer.catch_up_sync` does, before the Trainer is built)
            state = dataclasses.replace(state, version=await coordinator.sync(), sync_due=False)
        else:
            await coordinator.republish()
    return coordinator, state


def start_reporter(procs, coordinator) -> Any:
    """The Trainer's group source: the consumer, metered when metrics are on (its waits timed,
    each step reported by a `TrainerReporter`, closed with the metric service)."""
    if procs.metrics is None:
        return procs.consumer
    from asyncrl.metrics.report import MeteredSource, TrainerReporter

    source = MeteredSource(procs.consumer)
    procs.metrics.reporter = TrainerReporter(procs.metrics.emitter("trainer"), source, coordinator, procs.consumer)
    return source


def start_restarter(procs, cfg, plan, coordinator):
    """The Trainer's syncer: the coordinator's sync told to the Rollouter, with an `EngineRestarter`
    whose restarts under way at close are cancelled, their actors killed, each reported."""
    import ray

    from asyncrl.restarts import EngineRestarter, NotifyingSyncer

    def on_engine(i: int, handle) -> None:
        procs.engines[i] = handle  # closed with the others

    restarter = EngineRestarter(engine_starter(cfg, plan), cfg.engine.max_restarts, cfg.engine.restart_backoff_s)
    procs.stack.push_async_callback(restarter.close, ray.kill)
    return NotifyingSyncer(coordinator, procs.rollouter, restarter, on_engine)
