"""Runs side by side in one picture: reward against wall time and against step, and the Trainer's idle share.

    python -m asyncrl.plot runs/sync-0 runs/async-0 -o reward.png
    python -m asyncrl.plot runs/* -o reward.png --smooth 5 --title "calculator, tool latency 0.2 s"

Each run directory is one the launcher wrote: ``metrics.jsonl`` (one row per train step, `RunLog`)
and ``config.yaml`` (the resolved config). A run's label comes from its config: the mode (``sync``,
``sync+partial``, ``async``), the engine, the agent (an env, loop, function or command, by its
last name) and the seed; where two runs' labels would be the same, the directory name is added.
The panels:

- reward against wall time (``time_s``: seconds since the launcher started training);
- reward against step;
- the Trainer's idle share per step: ``timing_s/wait_data / timing_s/step``, the part of the step
  it waited for groups (near 1 in ``--mode sync`` with slow rollouts; near 0 when generation keeps
  up).

The reward is each step's mean sampled reward (``reward_mean``), drawn faint, with its running mean
over ``--smooth`` steps on top. Only matplotlib is needed (``pip install 'asyncrl[plot]'``); it is
imported when a figure is drawn, so reading runs needs nothing of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass(kw_only=True)
class Run:
    """One run directory's steps and label."""

    path: Path
    """The run directory."""
    label: str
    """The legend's name for it (from its config)."""
    rows: list[dict] = field(default_factory=list)
    """``metrics.jsonl``'s rows, in step order."""

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of the rows that hold ``key``."""
        got = [(r["step"], float(r[key])) for r in self.rows if key in r and "step" in r]
        return [s for s, _ in got], [v for _, v in got]

    def idle_share(self) -> tuple[list[float], list[float]]:
        """(steps, share of each step the Trainer waited for groups)."""
        got = [(r["step"], r["timing_s/wait_data"] / r["timing_s/step"]) for r in self.rows
               if "timing_s/wait_data" in r and r.get("timing_s/step", 0) > 0]
        return [s for s, _ in got], [min(1.0, max(0.0, v)) for _, v in got]


def _short_name(kind: str, target: str | None) -> str | None:
    """An agent setting's short name: an env's or loop's class (``CalculatorEnv``), a function's
    last two modules and name (``openai_agent.agent:run``), a command's script with its folder
    (``command_agent/agent.py``)."""
    if not target:
        return None
    target = str(target)
    if kind == "command":
        script = Path(target.split()[-1])
        return f"{script.parent.name}/{script.name}" if script.parent.name else script.name
    module, _, name = target.rpartition(":")
    return name if kind in ("env", "loop") else f"{'.'.join(module.split('.')[-2:])}:{name}"


def config_label(config: dict) -> str:
    """A run's label from its resolved config (missing sections leave their part out)."""
    mode = config.get("mode", "async")
    if (config.get("partial_rollout") or {}).get("enable"):
        mode += "+partial"
    parts = [mode]
    engine = (config.get("engine") or {}).get("kind")
    if engine and engine != "auto":
        parts.append(str(engine))
    agent = (config.get("rollout") or {}).get("agent") or {}
    name = next((n for n in (_short_name(k, agent.get(k)) for k in ("env", "loop", "function", "command")) if n), None)
    if name:
        parts.append(name)
    if "seed" in config:
        parts.append(f"seed {config['seed']}")
    return " ".join(parts)


def read_run(path: Path) -> Run:
    """A run directory's metrics and label; FileNotFoundError names a directory without metrics."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics}: not a run directory with metrics (the launcher writes metrics.jsonl "
                                "into --run-dir once a step is trained)")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    config_path = path / "config.yaml"
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
    label = config_label(config or {}) if config else path.name
    return Run(path=path, label=label, rows=sorted(rows, key=lambda r: r.get("step", 0)))


def read_runs(paths: list[Path]) -> list[Run]:
    """The runs, labels made distinct by their directory names where the configs say the same."""
    runs = [read_run(Path(p)) for p in paths]
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in runs:
        if seen[r.label] > 1:
            r.label = f"{r.label} ({r.path.name})"
    return runs


def running_mean(values: list[float], k: int) -> list[float]:
    """The mean of the last ``k`` values at each point (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= k:
            total -= values[i - k]
        out.append(total / min(i + 1, k))
    return out


def draw(runs: list[Run], out: Path, *, smooth: int = 5, title: str | None = None) -> Path:
    """Draws the three panels of ``runs`` into ``out`` (PNG, SVG or PDF by its suffix)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed (CI, a server)
    import matplotlib.pyplot as plt

    fig, (by_time, by_step, idle) = plt.subplots(1, 3, figsize=(16, 4.6))
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        steps, reward = run.series("reward_mean")
        _, times = run.series("time_s")
        smooth_reward = running_mean(reward, max(1, smooth))
        if len(times) == len(reward):
            by_time.plot(times, reward, color=color, alpha=0.25, linewidth=1)
            by_time.plot(times, smooth_reward, color=color, label=run.label, linewidth=2)
        by_step.plot(steps, reward, color=color, alpha=0.25, linewidth=1)
        by_step.plot(steps, smooth_reward, color=color, label=run.label, linewidth=2)
        idle_steps, share = run.idle_share()
        idle.plot(idle_steps, share, color=color, label=run.label, linewidth=1.5)
    by_time.set(xlabel="wall time (s)", ylabel=f"reward (running mean of {smooth} steps)", title="reward against time")
    by_step.set(xlabel="train step", ylabel="reward", title="reward against step")
    idle.set(xlabel="train step", ylabel="wait_data / step", title="Trainer idle share", ylim=(0, 1.05))
    for ax in (by_time, by_step, idle):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncrl.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", type=Path, help="run directories (each with metrics.jsonl)")
    p.add_argument("-o", "--out", type=Path, required=True, help="the figure's file (.png, .svg, .pdf)")
    p.add_argument("--smooth", type=int, default=5, help="steps in the reward's running mean (1: none)")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    try:
        runs = read_runs(args.run_dirs)
    except FileNotFoundError as e:
        print(f"asyncrl.plot: {e}", file=sys.stderr)
        return 2
    draw(runs, args.out, smooth=args.smooth, title=args.title)
    print(f"asyncrl.plot: {len(runs)} runs drawn into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
