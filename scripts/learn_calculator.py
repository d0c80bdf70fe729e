"""The calculator demo's gate: ``python -m asyncrl.launch --task calculator`` per engine and seed, summarised.

Each run is the whole launcher (Ray, engine actor, Rollouter with the task's agent loop, ZeroMQ
stream, FSDP2 trainer rank, weight sync) from empty caches: a fresh ``XDG_CACHE_HOME``, vLLM and
inductor cache directory per run. From its ``metrics.jsonl`` it takes the mean sampled reward and
tool calls per turn over the first and the last 20% of steps; the gate is, per run, last >= first
+ 0.2 and a wall time under 5 minutes.

    python scripts/learn_calculator.py                          # both engines, seeds 0 1 2 (~15-20 min)
    python scripts/learn_calculator.py --engines torch --seeds 0

Last line: JSON ``{"runs": [{"engine", "seed", "wall_s", "reward_first", "reward_last", "gain",
"tool_calls_per_turn_first", "tool_calls_per_turn_last", "gate"}, ...], "gate_met": bool}``.
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
GAIN, WALL_S = 0.2, 300.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", nargs="+", default=["torch", "vllm"], choices=("torch", "vllm"))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--fraction", type=float, default=0.2, help="share of steps in the first/last window")
    p.add_argument("extra", nargs="*", help="more launcher overrides (key=value), e.g. steps=80")
    return p.parse_args(argv)


def window(history: list[dict], key: str, fraction: float) -> tuple[float, float]:
    rows = [m for m in history if key in m]
    w = max(1, round(fraction * len(rows)))
    return sum(m[key] for m in rows[:w]) / w, sum(m[key] for m in rows[-w:]) / w


def calls_per_turn(history: list[dict], fraction: float) -> tuple[float, float]:
    """Tool calls per turn over the first and the last ``fraction`` of steps: the sums' ratio (a
    step's own ratio swings with which turns of the conversations its window caught)."""
    rows = [m for m in history if "agent/step_turns" in m]
    w = max(1, round(fraction * len(rows)))
    ratio = lambda part: sum(m["agent/step_tool_calls"] for m in part) / max(sum(m["agent/step_turns"] for m in part), 1)
    return ratio(rows[:w]), ratio(rows[-w:])


def run(engine: str, seed: int, fraction: float, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="learn-calculator-") as tmp:
        tmp = Path(tmp)
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "cache"), "VLLM_CACHE_ROOT": str(tmp / "cache/vllm"),
               "TORCHINDUCTOR_CACHE_DIR": str(tmp / "cache/inductor")}
        cmd = [sys.executable, "-m", "asyncrl.launch", "--task", "calculator", "--seed", str(seed),
               "--run-dir", str(tmp / "run"), f"engine.kind={engine}", "max_restarts=0", *extra]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{(out.stdout + out.stderr)[-3000:]}")
        history = [json.loads(line) for line in (tmp / "run/metrics.jsonl").read_text().splitlines()]
    first, last = window(history, "reward_mean", fraction)
    calls_first, calls_last = calls_per_turn(history, fraction)
    row = {"engine": engine, "seed": seed, "steps": len(history), "wall_s": round(wall, 1),
           "reward_first": round(first, 3), "reward_last": round(last, 3), "gain": round(last - first, 3),
           "tool_calls_per_turn_first": round(calls_first, 3), "tool_calls_per_turn_last": round(calls_last, 3)}
    row["gate"] = row["gain"] >= GAIN and wall < WALL_S
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.2f}", flush=True)
    runs = []
    for engine in args.engines:
        for seed in args.seeds:
            row = run(engine, seed, args.fraction, args.extra)
            runs.append(row)
            print(f"{engine:5s} seed {seed}: reward {row['reward_first']:.3f} -> {row['reward_last']:.3f} "
                  f"({row['gain']:+.3f}), tool calls/turn {row['tool_calls_per_turn_first']:.2f} -> "
                  f"{row['tool_calls_per_turn_last']:.2f}, {row['wall_s']:.0f} s, load {os.getloadavg()[0]:.2f}"
                  f"{'' if row['gate'] else '  GATE MISSED'}", flush=True)
    print(json.dumps({"runs": runs, "gate_met": all(r["gate"] for r in runs)}))
    return 0 if all(r["gate"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
