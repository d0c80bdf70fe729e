"""`asyncrl.plot`: run directories written by the launcher's own writers (config.yaml, RunLog's
metrics.jsonl), labelled from their configs and drawn into a PNG."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.launch import _make_run_dir
from asyncrl.plot import main, read_runs, running_mean
from asyncrl.progress import RunLog


def write_run(run_dir: Path, overrides: list[str], rewards: list[float], wait_share: float) -> Path:
    _, resolved = load_config([], overrides)
    _make_run_dir(run_dir, resolved)
    log = RunLog(run_dir, len(rewards))
    for i, reward in enumerate(rewards, start=1):
        log.write(None, {"step": i, "version": i, "reward_mean": reward, "loss": 0.0, "staleness_mean": 0.0,
                         "response_length_mean": 4.0, "tokens_per_s": 10.0, "time_s": 2.0 * i,
                         "timing_s/step": 2.0, "timing_s/wait_data": 2.0 * wait_share})
    log.close()
    return run_dir


def test_labels_come_from_each_config_and_idle_share_from_the_timings(tmp_path, capsys):
    sync = write_run(tmp_path / "a", ["mode=sync", "seed=1"], [0.1, 0.2, 0.3, 0.4], wait_share=0.75)
    partial = write_run(tmp_path / "b", ["mode=sync", "partial_rollout.enable=true", "seed=1"], [0.1, 0.5], 0.5)
    fast = write_run(tmp_path / "c", ["seed=1", "engine.kind=torch", "rollout.agent.env=asyncrl.tasks.calculator:CalculatorEnv"],
                     [0.3, 0.3, 0.9], wait_share=0.25)
    agent = write_run(tmp_path / "e", ["data.task=calculator", "rollout.agent.function=examples.openai_agent.agent:run"],
                      [0.2], wait_share=0.5)
    command = write_run(tmp_path / "f", ["data.task=calculator", "mode=sync",
                                         "rollout.agent.command=python examples/command_agent/agent.py"], [0.2], 0.5)
    twin = write_run(tmp_path / "d", ["mode=sync", "seed=1"], [0.0], wait_share=3.0)  # clipped to 1
    capsys.readouterr()
    runs = read_runs([sync, partial, fast, twin, agent, command])
    assert [r.label for r in runs] == ["sync seed 1 (a)", "sync+partial seed 1", "async torch CalculatorEnv seed 1",
                                       "sync seed 1 (d)", "async openai_agent.agent:run seed 0",
                                       "sync command_agent/agent.py seed 0"]
    assert runs[0].series("reward_mean") == ([1, 2, 3, 4], [0.1, 0.2, 0.3, 0.4])
    assert runs[0].series("time_s")[1] == [2.0, 4.0, 6.0, 8.0]
    assert runs[2].idle_share() == ([1, 2, 3], [0.25, 0.25, 0.25])
    assert runs[3].idle_share() == ([1], [1.0])
    out = tmp_path / "fig" / "reward.png"
    assert main([str(sync), str(partial), str(fast), "-o", str(out), "--smooth", "2"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # three panels of lines, not an empty canvas
    assert "3 runs drawn" in capsys.readouterr().out


def test_running_mean_and_a_directory_without_metrics(tmp_path, capsys):
    assert running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert running_mean([2.0], 5) == [2.0]
    assert main([str(tmp_path), "-o", str(tmp_path / "x.png")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err and not (tmp_path / "x.png").exists()
    with pytest.raises(FileNotFoundError, match="not a run directory"):
        read_runs([tmp_path])
