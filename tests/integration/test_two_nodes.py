"""A run across two Ray nodes on CPU: Rollouter and engine on one, Trainer on the other, the real
stream (CURVE on, routable address) and the real weight sync."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_node_run_with_curve_stream_and_weight_sync(tmp_path, two_ray_nodes):
    model = build_tiny_model(tmp_path / "model")
    with two_ray_nodes(2) as cluster:
        run_dir = tmp_path / "run"
        env = {**os.environ, "RAY_ADDRESS": cluster.address, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "asyncrl.launch", "--model", str(model), "--nodes", "2", "--steps", "2",
               "--n", "2", "--groups-per-step", "2", "--max-tokens", "3", "--lr", "1e-3", "--run-dir", str(run_dir)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=ROOT, env=env)
        assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
        # the plan's line per node: "node ADDR (ID)  GPUs u/n  CPUs u/n  rollouter (...); engine 0 (...)"
        lines = re.findall(r"^\s+node \S+ \((\w+)\)\s+GPUs \S+\s+CPUs \S+\s+(.*)$", out.stdout, re.M)
        nodes = {who: node for node, what in lines for who in ("rollouter", "engine 0", "trainer rank 0")
                 if re.search(rf"(^|; ){who} \(", what)}
        assert len(lines) == 2 and nodes["rollouter"] == nodes["engine 0"] != nodes["trainer rank 0"], out.stdout
        stream = re.search(r"sample stream on tcp://([\d.]+):(\d+) \(CURVE", out.stdout)
        assert stream and stream.group(1) != "127.0.0.1", out.stdout
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        # One weight sync after each step: the version the Trainer reports counts them.
        assert [r["step"] for r in rows] == [1, 2] and [r["version"] for r in rows] == [1, 2]
        assert all(r["groups"] == 2 for r in rows)
