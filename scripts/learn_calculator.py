"""The calculator demo's gate: ``python -m asyncrl.launch --task calculator`` per engine and seed, summarised.

Each run is the whole launcher (Ray, engine actor, Rollouter with the task's agent loop, ZeroMQ
stream, FSDP2 trainer rank, weight sync) from empty caches: a fresh ``XDG_CACHE_HOME``, vLLM and
inductor cache directory per run. From its ``metrics.jsonl`` it takes the mean sampled reward and
tool calls per turn over the first and the last 20% of steps; the gate is, per run, last >= first
+ 0.2 and a wall time under 5 minutes.

With ``--agent STACK`` the runs train one of the agent stacks of ``examples/`` through the
run's OpenAI-compatible endpoint instead of the task's built-in `Env` (``openai``: the plain
loop on the ``openai`` client; ``agents_sdk``; ``langgraph``; ``command``: a subprocess per
episode), and each (engine, seed) also runs the built-in `Env` beside it, the two back to back
in alternating order, so that ``vs_env_time`` (agent run's wall time / the Env run's) compares
runs made under the same load. The gate then also asks ``vs_env_time <= 1.3``. An endpoint run's
tool calls per turn come from the conversations the Trainer kept (``transcripts.jsonl``, one per
group). ``is_ratio_dev`` is the largest |importance ratio - 1| over the steps: ~0 in ``mode=sync``
(the trained tokens are the sampled ones), spread by design in async mode.

    python scripts/learn_calculator.py                          # both engines, seeds 0 1 2 (~15-20 min)
    python scripts/learn_calculator.py --engines torch --seeds 0
    python scripts/learn_calculator.py --agent openai --json    # stack 1 and the Env, side by side

Last line: JSON ``{"runs": [{"engine", "seed", "agent", "wall_s", "reward_first", "reward_last",
"gain", "tool_calls_per_turn_first", "tool_calls_per_turn_last", "is_ratio_dev", "gate"}, ...], "gains":
{engine: {seed: gain}}, "seconds": {engine: {seed: wall_s}}, "gate_met": bool}``; with
``--agent`` also ``"agent"``, ``"env_gains"``, ``"env_seconds"`` and ``"vs_env_time"`` (same
shape; the agent's runs fill ``runs``, ``gains`` and ``seconds``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GAIN, WALL_S, VS_ENV = 0.2, 300.0, 1.3
AGENTS = {
    "openai": "rollout.agent.function=examples.openai_agent.agent:run",
    "agents_sdk": "rollout.agent.function=examples.agents_sdk_agent.agent:run",
    "langgraph": "rollout.agent.function=examples.langgraph_agent.agent:run",
    "command": "rollout.agent.command=python examples/command_agent/agent.py",
}
"""The stacks of ``examples/`` (docs/agent_stacks.md), as launcher overrides."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", nargs="+", default=["torch", "vllm"], choices=("torch", "vllm"))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--fraction", type=float, default=0.2, help="share of steps in the first/last window")
    p.add_argument("--agent", choices=sorted(AGENTS), default=None,
                   help="train this stack of examples/ through the endpoint, each run beside the built-in Env's")
    p.add_argument("--json", action="store_true", help="accepted for symmetry: the last line is always the JSON")
    p.add_argument("extra", nargs="*", help="more launcher overrides (key=value), e.g. steps=80")
    return p.parse_args(argv)


def window(history: list[dict], key: str, fraction: float) -> tuple[float, float]:
    rows = [m for m in history if key in m]
    w = max(1, round(fraction * len(rows)))
    return sum(m[key] for m in rows[:w]) / w, sum(m[key] for m in rows[-w:]) / w


def calls_per_turn_of_transcripts(run_dir: Path, steps: int, fraction: float) -> tuple[float, float]:
    """Tool calls per model turn over the first and the last ``fraction`` of steps, from the
    conversations the Trainer kept (``transcripts.jsonl``: the first of each trained group): an
    endpoint agent's tools run in the agent, so the Rollouter counts no tool calls of its own."""
    from asyncrl.models import default_model_path, load_tokenizer
    from asyncrl.transcripts import read

    call_id = load_tokenizer(default_model_path("calculator")).convert_tokens_to_ids("<tool_call>")
    w = max(1, round(fraction * steps))
    records = read(run_dir)

    def ratio(wanted) -> float:
        part = [r for r in records if wanted(r["step"])]
        calls = sum(sum(1 for t, m in zip(r["response_ids"], r["loss_mask"]) if m and t == call_id) for r in part)
        return calls / max(sum(r["turns"] for r in part), 1)

    return ratio(lambda step: step <= w), ratio(lambda step: step > steps - w)


def calls_per_turn(history: list[dict], fraction: float) -> tuple[float, float]:
    """Tool calls per turn over the first and the last ``fraction`` of steps: the sums' ratio (a
    step's own ratio swings with which turns of the conversations its window caught)."""
    rows = [m for m in history if "agent/step_turns" in m]
    w = max(1, round(fraction * len(rows)))
    ratio = lambda part: sum(m["agent/step_tool_calls"] for m in part) / max(sum(m["agent/step_turns"] for m in part), 1)
    return ratio(rows[:w]), ratio(rows[-w:])


def run(engine: str, seed: int, fraction: float, extra: list[str], agent: str | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="learn-calculator-") as tmp:
        tmp = Path(tmp)
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "cache"), "VLLM_CACHE_ROOT": str(tmp / "cache/vllm"),
               "TORCHINDUCTOR_CACHE_DIR": str(tmp / "cache/inductor"),
               # the Rollouter's Ray worker imports the agent from examples/ (the repository root)
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "asyncrl.launch", "--task", "calculator", "--seed", str(seed),
               "--run-dir", str(tmp / "run"), f"engine.kind={engine}", "max_restarts=0",
               *([AGENTS[agent]] if agent else []), *extra]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{(out.stdout + out.stderr)[-3000:]}")
        history = [json.loads(line) for line in (tmp / "run/metrics.jsonl").read_text().splitlines()]
        calls_first, calls_last = (calls_per_turn_of_transcripts(tmp / "run", len(history), fraction) if agent
                                   else calls_per_turn(history, fraction))
    first, last = window(history, "reward_mean", fraction)
    row = {"engine": engine, "seed": seed, "agent": agent or "env", "steps": len(history), "wall_s": round(wall, 1),
           "reward_first": round(first, 3), "reward_last": round(last, 3), "gain": round(last - first, 3),
           "tool_calls_per_turn_first": round(calls_first, 3), "tool_calls_per_turn_last": round(calls_last, 3)}
    # Exact tokens: in --mode sync the Trainer's importance ratio is 1 up to float error.
    row["is_ratio_dev"] = round(max((abs(m[k] - 1.0) for m in history for k in ("is_ratio_min", "is_ratio_max")
                                     if k in m), default=float("nan")), 5)
    row["gate"] = row["gain"] >= GAIN and wall < WALL_S
    return row


def per_seed(runs: list[dict], key: str) -> dict[str, dict[str, float]]:
    """``{engine: {seed: run[key]}}`` (seeds as strings: JSON's keys)."""
    out: dict[str, dict[str, float]] = {}
    for r in runs:
        out.setdefault(r["engine"], {})[str(r["seed"])] = r[key]
    return out


def summary(runs: list[dict], env_runs: list[dict], agent: str | None) -> dict:
    """The JSON last line; with ``agent``, each agent run's gate also asks for the Env's wall time x 1.3."""
    out = {"runs": runs, "gains": per_seed(runs, "gain"), "seconds": per_seed(runs, "wall_s")}
    if agent:
        env_wall = {(r["engine"], r["seed"]): r["wall_s"] for r in env_runs}
        for r in runs:
            r["vs_env_time"] = round(r["wall_s"] / env_wall[r["engine"], r["seed"]], 3)
            r["gate"] = r["gate"] and r["vs_env_time"] <= VS_ENV
        out.update(agent=agent, env_runs=env_runs, env_gains=per_seed(env_runs, "gain"),
                   env_seconds=per_seed(env_runs, "wall_s"), vs_env_time=per_seed(runs, "vs_env_time"))
    out["gate_met"] = all(r["gate"] for r in runs)
    return out


def _line(row: dict) -> str:
    return (f"{row['engine']:5s} seed {row['seed']} {row['agent']:10s}: reward {row['reward_first']:.3f} -> "
            f"{row['reward_last']:.3f} ({row['gain']:+.3f}), tool calls/turn {row['tool_calls_per_turn_first']:.2f} -> "
            f"{row['tool_calls_per_turn_last']:.2f}, {row['wall_s']:.0f} s, load {os.getloadavg()[0]:.2f}"
            f"{'' if row['gate'] else '  GATE MISSED'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    runs, env_runs = [], []
    for engine in args.engines:
        for i, seed in enumerate(args.seeds):
            # With an agent, the Env's run of the same seed goes beside it, the order alternating
            # so that a drift in the machine's load falls on both.
            order = [args.agent] if not args.agent else [None, args.agent] if i % 2 == 0 else [args.agent, None]
            for agent in order:
                row = run(engine, seed, args.fraction, args.extra, agent)
                (runs if agent == args.agent else env_runs).append(row)
                print(_line(row), flush=True)
    out = summary(runs, env_runs, args.agent)
    if args.agent:
        print("wall time / Env's: " + ", ".join(f"{e} seed {s} {v:.2f}x" for e, by in out["vs_env_time"].items()
                                                 for s, v in by.items()) + f" (target <= {VS_ENV})", flush=True)
    print(json.dumps(out))
    return 0 if out["gate_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
