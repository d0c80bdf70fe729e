"""Trainer ranks on two Ray nodes form one world at a store rank 0 bound on its own node."""

from __future__ import annotations

import pytest

from asyncrl.models.tiny import build_tiny_model
from asyncrl.trainer.config import TrainerConfig, WorkerConfig


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_on_two_nodes_join_one_world(tmp_path, two_ray_nodes):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from asyncrl.trainer.ranks import RankGroup

    model = build_tiny_model(tmp_path / "model")
    with two_ray_nodes(1) as cluster:
        ray.init(address=cluster.address)
        try:
            nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
            assert len(nodes) == 2
            cfg = TrainerConfig(worker=WorkerConfig(model_path=str(model), device="cpu"), world_size=2)
            options = [{"num_cpus": 1, "scheduling_strategy": NodeAffinitySchedulingStrategy(n, soft=False)}
                       for n in nodes]
            ranks = RankGroup.start_ray(cfg, actor_options=options, across_nodes=True)
            try:
                assert ranks.call_sync("ready", timeout=120) == [0, 1]
                where = ray.get([w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                                 for w in ranks.workers])
                assert where == nodes
                # A collective over the world: rank 0 gathers the sharded weights from both nodes.
                full = ranks.call_sync("full_state_dict", timeout=120)
                assert full[1] == {} and "model.embed_tokens.weight" in full[0]
            finally:
                ranks.close()
        finally:
            ray.shutdown()
