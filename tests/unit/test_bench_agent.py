"""`scripts/bench_agent.py`'s time to reward: the start and end rewards, the first step whose running
mean reaches start + rise, the per-seed ratios to sync, and the launcher command per mode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_agent  # noqa: E402


def rows(rewards: list[float], step_s: float = 2.0) -> list[dict]:
    return [{"step": i + 1, "time_s": 10.0 + step_s * i, "reward_mean": r} for i, r in enumerate(rewards)]


def test_time_to_reward_is_the_first_running_mean_at_start_plus_rise():
    # step 1 (0.9) is left out; start = mean(0.1, 0.2) = 0.15; running means of 2: .15 .2 .25 .35 .45
    got = bench_agent.time_to_reward(rows([0.9, 0.1, 0.2, 0.2, 0.3, 0.4, 0.5]), window=2, rise=0.15)
    assert got["reward_start"] == pytest.approx(0.15) and got["reward_end"] == pytest.approx(0.45)
    assert got["time_to_reward_s"] == pytest.approx(10.0)  # step 6's mean 0.35 >= 0.30, 5 steps after step 1
    flat = bench_agent.time_to_reward(rows([0.0, 0.3, 0.3, 0.3, 0.4]), window=2, rise=0.15)
    assert flat["time_to_reward_s"] is None and flat["reward_end"] == pytest.approx(0.35)


def test_summary_pairs_each_seed_with_sync_and_counts_what_never_rose():
    run = lambda t, start, end: {"time_to_reward_s": t, "reward_start": start, "reward_end": end}
    out = bench_agent.summarize_reward({
        "sync": [run(100.0, 0.3, 0.6), run(80.0, 0.3, 0.6), run(120.0, 0.3, 0.6)],
        "async": [run(40.0, 0.3, 0.62), run(40.0, 0.3, 0.58), run(None, 0.3, 0.4)],
        "sync_partial": [run(90.0, 0.3, 0.6), run(60.0, 0.3, 0.6), run(84.0, 0.3, 0.6)]})
    assert out["time_to_reward_s"] == {"sync": 100.0, "async": 40.0, "sync_partial": 84.0}
    assert out["reached"] == {"sync": "3/3", "async": "2/3", "sync_partial": "3/3"}
    assert out["time_ratio_async"] == pytest.approx(0.45)  # median of 0.4 and 0.5 (seed 2 never rose)
    assert out["time_ratio_sync_partial"] == pytest.approx(0.75)  # 0.9, 0.75, 0.7
    assert out["reward_end"]["async"] == pytest.approx(0.5333, abs=1e-4)
    assert out["reward_gap_async"] == pytest.approx(0.0667, abs=1e-4) and out["reward_gap_sync_partial"] == 0
    said = bench_agent.verdicts(out, 0.15)
    assert "time_ratio_async 0.45 (target <= 0.5: met)" in said
    assert any(s.startswith("async reward 0.300 -> 0.533 (rise +0.233") and s.endswith("met)") for s in said)


def test_launch_commands_per_mode_and_agent(tmp_path):
    args = bench_agent.parse_args(["--seeds", "0"])
    sync = bench_agent.launch_command(args, "sync", 0, tmp_path)
    assert sync[sync.index("--task") + 1] == "calculator" and "--lr" in sync and sync[sync.index("--lr") + 1] == "5e-05"
    assert "rollout.agent.kwargs.latency_median_s=0.2" in sync and "rollout.agent.kwargs.latency_p99_s=2.0" in sync
    asyn = bench_agent.launch_command(args, "async", 0, tmp_path)
    assert "rollout.max_concurrent=32" in asyn and asyn[asyn.index("--mode") + 1] == "async"
    agent = bench_agent.launch_command(bench_agent.parse_args(["--agent", "openai"]), "sync", 0, tmp_path)
    assert "rollout.agent.function=examples.openai_agent.agent:run" in agent
    assert not any(a.startswith("rollout.agent.kwargs") for a in agent)
    with pytest.raises(SystemExit):
        bench_agent.parse_args(["--agent", "openai", "--workload", "addition"])
