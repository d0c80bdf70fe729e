"""`asyncrl.placement.make_plan`: every process's node from the cluster's resources, without Ray."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.placement import Cluster, Node, PlacementError, make_plan


def nodes(*gpus: int, cpus: float = 32) -> Cluster:
    return Cluster(nodes=[Node(node_id=f"n{i}" + "0" * 20, address=f"10.0.0.{i}", cpus=cpus, gpus=g, head=i == 0)
                          for i, g in enumerate(gpus)], started_here=False)


def plan_of(cluster: Cluster, *overrides: str):
    cfg, _ = load_config([], list(overrides))
    return make_plan(cfg, cluster)


def test_one_node_of_16_gpus_hosts_8_replicas_and_8_ranks():
    plan = plan_of(nodes(16), "placement.rollouter_gpus=8", "placement.trainer_gpus=8")
    assert len(plan.engines) == 8 and len(plan.ranks) == 8
    assert all(s.gpus == 1 for s in plan.engines + plan.ranks)
    assert plan.single_node
    assert [s.bundle for s in plan.engines] == list(range(1, 9)) and plan.rollouter.bundle == 0
    assert [s.bundle for s in plan.ranks] == list(range(8))


def test_tensor_parallel_replicas_take_tp_gpus_each():
    plan = plan_of(nodes(16), "placement.rollouter_gpus=8", "placement.trainer_gpus=8", "engine.tensor_parallel_size=4")
    assert [s.gpus for s in plan.engines] == [4, 4]


def test_two_nodes_put_trainer_and_rollouter_apart():
    plan = plan_of(nodes(8, 8), "placement.rollouter_gpus=8", "placement.trainer_gpus=8", "placement.nodes=2")
    trainer_nodes = {s.node.address for s in plan.ranks}
    rollout_nodes = {s.node.address for s in [plan.rollouter, *plan.engines]}
    assert len(trainer_nodes) == 1 and len(rollout_nodes) == 1 and trainer_nodes != rollout_nodes


def test_cpu_run_on_two_nodes_puts_rollouter_and_engines_on_one_and_ranks_on_the_other():
    plan = plan_of(nodes(0, 0, cpus=4), "placement.engines=2", "placement.trainer_ranks=2", "placement.nodes=2")
    assert {s.node.address for s in plan.ranks} == {"10.0.0.0"}
    assert {s.node.address for s in [plan.rollouter, *plan.engines]} == {"10.0.0.1"}


@pytest.mark.parametrize("cluster, overrides, numbers", [
    (nodes(8), ("placement.rollouter_gpus=8", "placement.trainer_gpus=8"), ("16 GPUs", "have 8")),
    (nodes(8, 8), ("placement.rollouter_gpus=8", "placement.trainer_gpus=8", "placement.gpus_per_node=4",
                   "placement.nodes=2"), ("16 GPUs", "have 8")),
    (nodes(8, 8), ("placement.rollouter_gpus=8", "placement.trainer_gpus=8", "placement.nodes=3"),
     ("placement.nodes=3", "2 alive node(s)")),
    (nodes(6, 6), ("placement.rollouter_gpus=8", "placement.trainer_gpus=4", "engine.tensor_parallel_size=4",
                   "placement.nodes=2", "engine.kind=vllm"), ("engine replica", "tensor_parallel_size=4")),
    (nodes(0, cpus=2), ("placement.engines=2", "placement.trainer_ranks=2"), ("no node has room", "CPUs")),
])
def test_too_much_asked_fails_with_the_numbers(cluster, overrides, numbers):
    with pytest.raises(PlacementError) as e:
        plan_of(cluster, *overrides)
    for n in numbers:
        assert n in str(e.value)


def test_a_64_node_plan_keeps_replicas_whole_and_sides_apart_and_prints_a_line_per_node():
    # 64 nodes x 8 GPUs, --rollouter-gpus 256 --trainer-gpus 256, TP 4: the planning alone (64
    # raylets do not fit on a test machine; the dry run's reservation is tested on 1 and 2 nodes)
    cluster = Cluster(nodes=[Node(node_id=f"{i:04d}" + "ab" * 14, address=f"10.1.{i // 250}.{i % 250}", cpus=96,
                                  gpus=8, head=i == 0) for i in range(64)], started_here=False)
    plan = plan_of(cluster, "placement.rollouter_gpus=256", "placement.trainer_gpus=256",
                   "engine.tensor_parallel_size=4", "placement.nodes=64")
    assert len(plan.engines) == 64 and {s.gpus for s in plan.engines} == {4}
    assert len(plan.ranks) == 256 and {s.gpus for s in plan.ranks} == {1}
    used: dict[str, int] = {}
    for s in [plan.rollouter, *plan.engines, *plan.ranks]:
        used[s.node.node_id] = used.get(s.node.node_id, 0) + s.gpus
    assert len(used) == 64 and set(used.values()) == {8}  # every GPU used once, no node over its 8
    trainer_nodes = {s.node.node_id for s in plan.ranks}
    rollout_nodes = {s.node.node_id for s in [plan.rollouter, *plan.engines]}
    assert len(trainer_nodes) == len(rollout_nodes) == 32 and not trainer_nodes & rollout_nodes
    assert [s.bundle for s in plan.engines] == list(range(1, 65)) and [s.bundle for s in plan.ranks] == list(range(256))
    lines = plan.describe().splitlines()
    assert lines[0] == "plan: 64 engine replica(s) of 4 GPU(s), 256 trainer rank(s) on 64 node(s)"
    assert len(lines) == 65
    assert lines[1].startswith("  node 10.1.0.0 (0000abababab)  GPUs 8/8  CPUs 8/96  ")
    assert lines[1].endswith("trainer ranks 0-7 (1 GPU each, trainer 0-7)")
    (home,) = [line for line in lines if "rollouter" in line]
    assert home.endswith("GPUs 8/8  CPUs 3/96  rollouter (rollout 0); engines 0-1 (4 GPUs each, rollout 1-2)")


def test_the_plan_of_the_cpu_demo_is_one_line():
    plan = plan_of(Cluster([Node("c" * 24, "127.0.0.1", cpus=8, gpus=0, head=True)], started_here=True))
    assert plan.describe().splitlines()[1:] == [
        "  node 127.0.0.1 (cccccccccccc)  GPUs 0/0  CPUs 3/8  rollouter (rollout 0); engine 0 (rollout 1); "
        "trainer rank 0 (trainer 0)"]


def _ray_node(i: int, gpus: int, alive: bool) -> dict:
    """One entry of ``ray.nodes()``, as Ray reports it."""
    res = {"CPU": 32.0, "GPU": float(gpus), **({"node:__internal_head__": 1.0} if i == 0 else {})}
    return {"NodeID": f"n{i}" + "0" * 20, "NodeManagerAddress": f"10.0.0.{i}", "Alive": alive, "Resources": res}


def test_a_run_restarted_after_a_node_died_is_planned_on_the_nodes_left(tmp_path, monkeypatch):
    """The restart loop plans again from the nodes Ray reports alive (`alive_nodes`): the node
    that went with the dead process hosts nothing in the new plan."""
    import ray
    import ray.exceptions

    from asyncrl import launch, placement

    cfg, _ = load_config([], ["placement.rollouter_gpus=8", "placement.trainer_gpus=8", "placement.nodes=2",
                              "max_restarts=1", "restart_backoff_s=0"])
    ray_nodes = [_ray_node(i, 8, alive=True) for i in range(3)]
    monkeypatch.setattr(ray, "nodes", lambda: ray_nodes)
    cluster = placement.Cluster(nodes=placement.alive_nodes(), started_here=False)
    first = make_plan(cfg, cluster)
    rollout_node = first.rollouter.node.address
    assert rollout_node == "10.0.0.1" and {s.node.address for s in first.engines} == {rollout_node}
    plans = []

    async def run(cfg_, plan, run_dir):
        plans.append(plan)
        if len(plans) == 1:  # the Rollouter's node goes, and the Rollouter with it
            ray_nodes[1] = _ray_node(1, 8, alive=False)
            raise ray.exceptions.ActorDiedError()
        return 0

    monkeypatch.setattr(launch, "run", run)
    assert launch.run_restarting(cfg, first, cluster, tmp_path) == 0
    again = plans[1]
    used = {s.node.address for s in [again.rollouter, *again.engines, *again.ranks]}
    assert rollout_node not in used and used == {"10.0.0.0", "10.0.0.2"}
    assert {s.node.address for s in again.ranks} == {"10.0.0.0"} and len(again.engines) == 8
