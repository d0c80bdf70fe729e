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
