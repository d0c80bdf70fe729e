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
run stopped in a weight sync: `asyncrl.starters.start_sync` runs that sync instead); the Rollouter
regenerates, by id, every id it had admitted that the checkpoint does not hold as trained or
dropped, then feeds new ids from ``next_index`` (`RolloutState.resume`).

Start and close: one starter per part (`asyncrl.starters`) starts it and registers its close on
``Processes.stack`` in the same place, so `Processes.close` closes them in the reverse order of
their start: restarts under way (cancelled, reported), the Rollouter (drained: no new prompts,
in-flight requests aborted), the aggregator, the stream, the ranks, the engines, the dashboard,
the metrics, the placement groups; a hard stop kills them without asking. The `Trainer` is built
last, once, with everything it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.restarts import EngineRestarter, FeedState, NotifyingSyncer  # noqa: F401 - their old home

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
    stack: contextlib.AsyncExitStack = dataclasses.field(default_factory=contextlib.AsyncExitStack)
    """Each part's close, registered by its starter (`asyncrl.starters`) as it starts."""
    drain: bool = True
    """How the closes run (set by `close`): drained (asked first), or killed at once."""
    timeout_s: float = 30.0
    """Deadline of each drained close (set by `close`)."""

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
        """Stop everything in the reverse order of its start: restarts under way, the Rollouter
        (drained), the aggregator, the stream, the ranks, the engines, the dashboard, the metrics,
        the placement groups (each drained close under ``timeout_s``); ``drain=False`` kills at once."""
        self.drain, self.timeout_s = drain, timeout_s
        await self.stack.aclose()


async def start(cfg, plan, run_dir: Path) -> Processes:
    """Reserve the plan's placement groups and start engines, ranks, stream and Rollouter on them."""
    print(f"asyncrl: run dir {run_dir}; model {cfg.model_path}; {cfg.engine_replicas} engine replica(s), "
          f"{cfg.trainer_world_size} trainer rank(s)", flush=True)
    print(plan.describe(), flush=True)
    plan.reserve()
    procs = Processes(plan=plan, engines=[])
    procs.stack.callback(plan.release)
    try:
        await _start_parts(procs, cfg, plan, run_dir)
        print(f"asyncrl: mode {cfg.mode}" + (", partial rollout" if cfg.partial_rollout.enable else ""), flush=True)
        return procs
    except TimeoutError as e:  # a process that does not come up: say where each one waits
        where = where_they_wait(run_dir, f"start-up: {e}")
        await procs.close(drain=False)
        raise TimeoutError(f"{e}; {where}") from None
    except BaseException:
        await procs.close(drain=False)
        raise


async def _start_parts(procs: Processes, cfg, plan, run_dir: Path) -> None:
    """Every part, in start order (each starter registers its close), then the Trainer, built once."""
    from asyncrl import starters
    from asyncrl.trainer.trainer import Trainer

    starters.start_metrics(procs, cfg, run_dir)
    engines_ready = starters.start_engines(procs, cfg, plan)  # they start while the ranks do
    net = addresses(cfg, plan)
    tcfg = _trainer_config(cfg, run_dir)
    starters.start_ranks(procs, tcfg, plan, net.ranks_across_nodes)
    await _ready(engines_ready, plan.ready_timeout_s, "engine replicas")
    state = await starters.restore(procs, tcfg)
    stream = await starters.start_stream(procs, net, state)
    starters.start_aggregator(procs, cfg)
    await starters.start_rollouter(procs, cfg, plan, stream, state, _ready)
    coordinator, state = await starters.start_sync(procs, cfg, net, state)
    version = state.version if state is not None else 0
    await procs.rollouter.on_sync.remote(version)
    procs.rollout_run = procs.rollouter.run.remote()
    source = starters.start_reporter(procs, coordinator)
    syncer = starters.start_restarter(procs, cfg, plan, coordinator)
    rollouter = procs.rollouter
    procs.trainer = Trainer(tcfg, procs.ranks, source, syncer, restored=state,
                            rollouter_state=FeedState(rollouter, last=state.rollouter_state if state else None),
                            on_dropped=lambda ids: rollouter.on_dropped.remote(ids))


def _trainer_config(cfg, run_dir: Path):
    """The ranks' and the Trainer's config: the model's special token ids, the run's files."""
    pad_id, eos_id = _special_token_ids(cfg.model_path)
    return cfg.trainer_config(model_path=cfg.model_path, pad_token_id=pad_id, eos_token_id=eos_id,
                              checkpoint_dir=str(run_dir / "checkpoints"), samples_path=str(run_dir / "samples.jsonl"),
                              transcripts_path=str(run_dir / "transcripts.jsonl") if cfg.rollout.agent.enabled else None)


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
