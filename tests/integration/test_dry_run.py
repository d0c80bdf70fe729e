"""``--dry-run`` against real Ray clusters: the plan is reserved in placement groups, nothing heavy starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def dry_run(address: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ADDRESS": address}
    return subprocess.run([sys.executable, "-m", "asyncrl.launch", *args, "--dry-run"], capture_output=True,
                          text=True, timeout=240, cwd=ROOT, env=env)


def planned(stdout: str) -> dict[str, list[tuple[str, int, str]]]:
    """Process kind -> [(node id prefix, GPUs, placement group)], one entry per process, from the
    plan's node lines (``node ADDR (ID)  GPUs u/n  CPUs u/n  engines 0-1 (4 GPUs each, rollout 1-2); ...``)."""
    out: dict[str, list] = {"engine": [], "trainer": [], "rollouter": []}
    for node in re.finditer(r"^\s+node \S+ \((\w+)\)\s+GPUs \d+/\d+\s+CPUs \S+\s+(.*)$", stdout, re.M):
        for part in re.finditer(r"(rollouter|engines?|trainer ranks?)(?: ([\d,-]+))? \((?:(\d+) GPUs?(?: each)?, )?"
                                r"(\w+) [\d,-]+\)", node.group(2)):
            kind = part.group(1).split()[0].rstrip("s")
            count = len(expand(part.group(2))) if part.group(2) else 1
            out[kind] += [(node.group(1), int(part.group(3) or 0), part.group(4))] * count
    return out


def expand(ranges: str) -> list[int]:
    """``0-2,5`` -> ``[0, 1, 2, 5]``."""
    out = []
    for r in ranges.split(","):
        a, _, b = r.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


@pytest.fixture(scope="module")
def cluster_16_gpus():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 20, "num_gpus": 16})
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.mark.timeout(600)
def test_the_documented_command_plans_8_replicas_and_8_ranks(cluster_16_gpus):
    out = dry_run(cluster_16_gpus.address, "--rollouter-gpus", "8", "--trainer-gpus", "8")
    assert out.returncode == 0, out.stderr[-3000:]
    plan = planned(out.stdout)
    assert len(plan["engine"]) == 8 and all(g == 1 and pg == "rollout" for _, g, pg in plan["engine"])
    assert len(plan["trainer"]) == 8 and all(g == 1 and pg == "trainer" for _, g, pg in plan["trainer"])
    assert "placement groups reserved and released" in out.stdout
    assert "placement:\n  rollouter_gpus: 8\n  trainer_gpus: 8" in out.stdout  # the resolved config follows
    # Tensor parallel: 8 GPUs make 2 replicas of 4.
    out = dry_run(cluster_16_gpus.address, "--rollouter-gpus", "8", "--trainer-gpus", "8",
                  "engine.tensor_parallel_size=4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [g for _, g, _ in planned(out.stdout)["engine"]] == [4, 4]
    # Too many GPUs: exit 2 at once, with the numbers.
    out = dry_run(cluster_16_gpus.address, "--rollouter-gpus", "16", "--trainer-gpus", "8")
    assert out.returncode == 2
    assert "asked for 16 rollouter + 8 trainer = 24 GPUs, but 1 node(s) have 16" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(600)
def test_two_nodes_split_trainer_and_rollouter():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 10, "num_gpus": 8})
    try:
        cluster.add_node(num_cpus=10, num_gpus=8)
        cluster.wait_for_nodes()
        out = dry_run(cluster.address, "--rollouter-gpus", "8", "--trainer-gpus", "8", "--nodes", "2")
        assert out.returncode == 0, out.stderr[-3000:]
        plan = planned(out.stdout)
        assert len(plan["engine"]) == 8 and len(plan["trainer"]) == 8
        trainer_nodes = {n for n, _, _ in plan["trainer"]}
        rollout_nodes = {n for n, _, _ in plan["engine"] + plan["rollouter"]}
        assert len(trainer_nodes) == 1 and len(rollout_nodes) == 1 and trainer_nodes != rollout_nodes
        out = dry_run(cluster.address, "--rollouter-gpus", "8", "--trainer-gpus", "8")  # one node cannot hold 16
        assert out.returncode == 2 and "asked for 8 rollouter + 8 trainer = 16 GPUs, but 1 node(s) have 8" in out.stderr
    finally:
        cluster.shutdown()
