"""Placement on Ray: join or start a cluster, plan where every process runs, reserve it in placement groups.

::

    connect(placement)            join RAY_ADDRESS / placement.address (ray job submit sets it), else start a local Ray
    make_plan(cfg, cluster)       which node hosts each engine replica, each trainer rank and the Rollouter;
                                  too many GPUs or CPUs asked fails here, with the numbers
    plan.reserve()                two placement groups, every bundle pinned to its planned node:
                                    rollout: [Rollouter] + one bundle of tensor_parallel_size GPUs per replica
                                    trainer: one bundle per rank (gang-scheduled: all or none)
    plan.engine_options(i) ...    Ray actor options that put a process in its bundle

With ``placement.nodes >= 2`` the Trainer's ranks and the Rollouter's replicas go on separate
nodes (trainer first); with one node everything shares the node with the most GPUs (or the
head node on CPU). Left out: spreading one replica's tensor-parallel GPUs over several nodes,
heterogeneous GPU types.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class PlacementError(ValueError):
    """The cluster cannot host what the config asks for; one line with the numbers."""


@dataclass
class Node:
    """One alive Ray node and what the run may use on it."""

    node_id: str
    address: str
    cpus: float
    gpus: int
    head: bool = False


@dataclass
class Cluster:
    """The Ray cluster this launcher is connected to."""

    nodes: list[Node]
    started_here: bool
    """True when the launcher started a local Ray (it shuts it down at the end)."""


@dataclass
class Slot:
    """Where one process runs: its node, its resources, its bundle."""

    process: str
    node: Node
    cpus: float
    gpus: int
    group: str
    """``rollout`` or ``trainer``: the placement group."""
    bundle: int


@dataclass
class Plan:
    """Every process's place; `reserve` turns it into placement groups."""

    rollouter: Slot
    engines: list[Slot]
    ranks: list[Slot]
    ready_timeout_s: float
    groups: dict[str, Any] = field(default_factory=dict)
    """Placement groups by name, once reserved."""

    @property
    def single_node(self) -> bool:
        return len({s.node.node_id for s in [self.rollouter, *self.engines, *self.ranks]}) == 1

    def describe(self) -> str:
        """The plan, one line per node (a 64-node plan stays 65 lines): what runs there, in which bundles."""
        by_node: dict[str, list[Slot]] = {}
        for s in [*self.ranks, self.rollouter, *self.engines]:  # trainer nodes first, as they are planned
            by_node.setdefault(s.node.node_id, []).append(s)
        tp = self.engines[0].gpus if self.engines else 0
        lines = [f"plan: {len(self.engines)} engine replica(s)" + (f" of {tp} GPU(s)" if tp else "")
                 + f", {len(self.ranks)} trainer rank(s) on {len(by_node)} node(s)"]
        for slots in by_node.values():
            node = slots[0].node
            gpus, cpus = sum(s.gpus for s in slots), sum(s.cpus for s in slots)
            lines.append(f"  node {node.address} ({node.node_id[:12]})  GPUs {gpus}/{node.gpus}  "
                         f"CPUs {cpus:g}/{node.cpus:g}  " + "; ".join(_processes(slots)))
        return "\n".join(lines)

    # -------------------------------------------------------------------- reserve

    def reserve(self) -> None:
        """Create both placement groups and wait until Ray has reserved every bundle."""
        import ray
        from ray.util.placement_group import placement_group

        for name, slots in (("rollout", [self.rollouter, *self.engines]), ("trainer", self.ranks)):
            bundles = [{"CPU": s.cpus, **({"GPU": s.gpus} if s.gpus else {})} for s in slots]
            labels = [{"ray.io/node-id": s.node.node_id} for s in slots]
            self.groups[name] = placement_group(bundles, strategy="PACK", name="", bundle_label_selector=labels)
        for name, pg in self.groups.items():
            if not pg.wait(self.ready_timeout_s):
                self.release()
                raise PlacementError(f"the {name} placement group was not reserved within "
                                     f"placement.ready_timeout_s={self.ready_timeout_s} (see `ray status`)")
        for name, slots in (("rollout", [self.rollouter, *self.engines]), ("trainer", self.ranks)):
            reserved = self.reserved_nodes(name)
            moved = [s.process for s in slots if reserved.get(s.bundle) != s.node.node_id]
            if moved:
                self.release()
                raise PlacementError(f"Ray reserved {moved} on other nodes than planned")
        del ray

    def reserved_nodes(self, name: str) -> dict[int, str]:
        """Bundle index -> node id, as Ray reserved them (for checks and the dry run)."""
        from ray.util.placement_group import placement_group_table

        return dict(placement_group_table(self.groups[name])["bundles_to_node_id"])

    def options(self, slot: Slot) -> dict:
        """Ray actor options that run a process in ``slot``'s bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.groups[slot.group], placement_group_bundle_index=slot.bundle)
        return {"num_cpus": slot.cpus, "num_gpus": slot.gpus, "scheduling_strategy": strategy}

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self.groups = {}


def _processes(slots: list[Slot]) -> list[str]:
    """``rollouter (rollout 0)``, ``engines 0-3 (2 GPUs each, rollout 1-4)``, ``trainer rank 0 (1 GPU, trainer 0)``."""
    out = []
    for kind, many in (("rollouter", "rollouter"), ("engine", "engines"), ("trainer rank", "trainer ranks")):
        mine = [s for s in slots if s.process == kind or s.process.startswith(kind + " ")]
        if not mine:
            continue
        numbers = [int(s.process.rsplit(" ", 1)[1]) for s in mine if s.process != kind]
        name = f"{many if len(numbers) > 1 else kind} {_ranges(numbers)}" if numbers else kind
        gpus = mine[0].gpus  # every replica, every rank alike
        each = f"{gpus} GPU{'s' if gpus > 1 else ''}{' each' if len(mine) > 1 else ''}, " if gpus else ""
        out.append(f"{name} ({each}{mine[0].group} {_ranges([s.bundle for s in mine])})")
    return out


def _ranges(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for x in sorted(xs):
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


# -------------------------------------------------------------------------- connect


RAY_TASK_EVENTS = 10_000
"""Actor-call events the GCS of a Ray the launcher starts keeps (Ray's default: 100,000). A joined
cluster keeps its own setting (``RAY_task_events_max_num_task_in_gcs`` when it is started)."""


def same_priority() -> dict:
    """Ray ``_system_config`` for a local Ray: its workers keep the priority of the process that starts
    it. Ray renices every worker to 15 (``worker_niceness``) so that the driver stays responsive; in an
    asyncrl run the actors do all the work, so any other process of the machine would come first: with
    three busy processes beside it, a Ray actor took 148 s to start here instead of 4 (2026-11-26).
    A ``RAY_worker_niceness`` in the environment is left to decide."""
    return {} if "RAY_worker_niceness" in os.environ else {"worker_niceness": 0}


def connect(placement, cpu_actors: int) -> Cluster:
    """Join ``placement.address`` or ``RAY_ADDRESS`` (set by ``ray job submit``), else start a local Ray."""
    import logging

    import ray

    from asyncrl.rpc.auth import new_run_key, run_env

    new_run_key()  # one key per run, for every process of it (asyncrl.rpc.auth)
    address = placement.address or os.environ.get("RAY_ADDRESS")
    if address:
        # Ray's own "connecting..." lines would bury the launcher's one-line errors.
        ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING,
                 runtime_env={"env_vars": run_env()})
    else:
        # Every actor reserves one CPU; on a laptop they share the cores (torch uses 1 thread each).
        # address="local": a new instance even where another local one runs (a bare init would join it).
        # Ray's GCS keeps the events of the last 100,000 actor calls by default: a run makes one
        # call per request, so over 1000 demo steps the GCS grew 91 -> 361 MB (scripts/soak.py)
        # before it stopped. Keep RAY_TASK_EVENTS of them (Ray's own dashboard shows those).
        # Its workers keep the launcher's priority (same_priority: Ray would renice them to 15).
        start_local_ray(num_cpus=max(cpu_actors, os.cpu_count() or 1), log_to_driver=True,
                        logging_level=logging.WARNING,
                        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", **QUIET_WORKERS}},
                        _system_config={"task_events_max_num_task_in_gcs": RAY_TASK_EVENTS},
                        say=lambda line: print(f"asyncrl: {line}", flush=True))
    return Cluster(nodes=alive_nodes(), started_here=not address)


QUIET_WORKERS = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}
"""Environment of a local Ray's workers: no "Loading weights" bars from transformers in the run's output."""

_LOCAL_STARTS = 3
"""Tries to start a local Ray whose raylet did not register within Ray's 30 s (a loaded machine)."""


def start_local_ray(*, say: Callable[[str], None] | None = None, **init: Any) -> None:
    """``ray.init(address="local", include_dashboard=False, **init)``: a new local Ray, its workers at
    the caller's priority (`same_priority`, merged into ``_system_config``). Ray gives its raylet a
    fixed 30 s to register, which a machine busy with other work can exceed: that start is abandoned
    and a fresh one tried, up to ``_LOCAL_STARTS`` in all (``say`` is told of each retry). The
    launcher, the benchmarks and the tests start their local Ray through this. Its workers get
    this process's run key (`asyncrl.rpc.auth.run_env`)."""
    import logging

    import ray

    # Ray turns on token authentication for a new local cluster and says so in a warning that
    # would open every run's output; the launcher keeps the setting and drops the notice.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    from asyncrl.rpc.auth import run_env

    init = {"include_dashboard": False, **init}
    init["_system_config"] = {**init.get("_system_config", {}), **same_priority()}
    # Every worker of the run has the run's key (asyncrl.rpc.auth): its calls' MACs are made with it.
    runtime_env = init.get("runtime_env") or {}
    init["runtime_env"] = {**runtime_env, "env_vars": {**runtime_env.get("env_vars", {}), **run_env()}}
    for attempt in range(1, _LOCAL_STARTS + 1):
        try:
            ray.init(address="local", **init)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or attempt == _LOCAL_STARTS:
                raise
            if say is not None:
                say(f"the local Ray did not start in time ({e}); starting it again ({attempt}/{_LOCAL_STARTS - 1})")
            ray.shutdown()


def alive_nodes() -> list[Node]:
    import ray

    nodes = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        nodes.append(Node(node_id=n["NodeID"], address=n["NodeManagerAddress"], cpus=float(res.get("CPU", 0)),
                          gpus=int(res.get("GPU", 0)), head="node:__internal_head__" in res))
    return nodes


def disconnect(cluster: Cluster) -> None:
    import ray

    ray.shutdown()


# ----------------------------------------------------------------------------- plan


def make_plan(cfg, cluster: Cluster) -> Plan:
    """Assign every process to a node; `PlacementError` with the numbers when the cluster is too small."""
    p = cfg.placement
    gpu = cfg.gpu
    per_node = [min(n.gpus, p.gpus_per_node) if p.gpus_per_node else n.gpus for n in cluster.nodes]
    # Nodes with the most usable GPUs (or CPUs on a CPU run) first; the head node first among equals.
    order = sorted(range(len(cluster.nodes)),
                   key=lambda i: (-(per_node[i] if gpu else cluster.nodes[i].cpus), not cluster.nodes[i].head))
    if len(order) < p.nodes:
        raise PlacementError(f"placement.nodes={p.nodes} but the Ray cluster has {len(order)} alive node(s)")
    chosen = [cluster.nodes[i] for i in order[:p.nodes]]
    gpus_left = {n.node_id: g for n, g in zip(cluster.nodes, per_node)}
    cpus_left = {n.node_id: n.cpus for n in chosen}
    tp = cfg.engine.tensor_parallel_size if gpu else 0
    rank_cpus = cfg.trainer.cpus_per_rank

    if gpu:
        total = sum(gpus_left[n.node_id] for n in chosen)
        asked = p.rollouter_gpus + p.trainer_gpus
        if asked > total:
            detail = ", ".join(f"{n.address}: {gpus_left[n.node_id]}" for n in chosen)
            raise PlacementError(f"asked for {p.rollouter_gpus} rollouter + {p.trainer_gpus} trainer = {asked} GPUs, "
                                 f"but {p.nodes} node(s) have {total} ({detail})")

    # Trainer ranks fill nodes from the first; the Rollouter's side starts on the next node
    # when there are several, so the two never share a node's GPUs or cores.
    ranks: list[Slot] = []
    for r in range(cfg.trainer_world_size):
        node = _first_fit(chosen, gpus_left, cpus_left, gpus=1 if gpu else 0, cpus=rank_cpus,
                          what=f"trainer rank {r}", cfg=cfg)
        ranks.append(Slot(f"trainer rank {r}", node, rank_cpus, 1 if gpu else 0, "trainer", r))
    rollout_nodes = chosen[1:] if len(chosen) > 1 else chosen
    if len(chosen) > 1:
        trainer_ids = {s.node.node_id for s in ranks}
        rollout_nodes = [n for n in chosen if n.node_id not in trainer_ids] or rollout_nodes
    rollouter_node = _first_fit(rollout_nodes, gpus_left, cpus_left, gpus=0, cpus=1, what="the Rollouter", cfg=cfg)
    rollouter = Slot("rollouter", rollouter_node, 1, 0, "rollout", 0)
    engines = []
    for e in range(cfg.engine_replicas):
        node = _first_fit([rollouter_node, *rollout_nodes], gpus_left, cpus_left, gpus=tp, cpus=1,
                          what=f"engine replica {e}", cfg=cfg)
        engines.append(Slot(f"engine {e}", node, 1, tp, "rollout", e + 1))
    return Plan(rollouter=rollouter, engines=engines, ranks=ranks, ready_timeout_s=p.ready_timeout_s)


def _first_fit(nodes: list[Node], gpus_left: dict, cpus_left: dict, *, gpus: int, cpus: float, what: str, cfg) -> Node:
    for n in nodes:
        if gpus_left[n.node_id] >= gpus and cpus_left[n.node_id] >= cpus:
            gpus_left[n.node_id] -= gpus
            cpus_left[n.node_id] -= cpus
            return n
    free = ", ".join(f"{n.address}: {gpus_left[n.node_id]} GPUs, {cpus_left[n.node_id]:g} CPUs" for n in nodes)
    p = cfg.placement
    raise PlacementError(f"no node has room for {what} ({gpus} GPUs, {cpus:g} CPUs) with "
                         f"placement.nodes={p.nodes}, rollouter_gpus={p.rollouter_gpus}, "
                         f"trainer_gpus={p.trainer_gpus}, engine.tensor_parallel_size={cfg.engine.tensor_parallel_size}; "
                         f"left: {free}")
