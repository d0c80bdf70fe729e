"""Benchmark: what the metric stream and its sinks add to the CPU demo's time per step.

Runs ``python -m asyncrl.launch`` back to back, alternating ``metrics.enabled=false`` (no
stream: the launcher's metrics.jsonl and progress line only) with the metrics on (``--sinks``,
default every sink that runs here: jsonl, console, tensorboard, prometheus), ``--reps`` times each, and compares the median
s/step the launcher reports (steps 2..N: start-up and the first step excluded). Target:
metrics add at most 2%.

    python scripts/bench_metrics.py --steps 60 --reps 3          # human-readable
    python scripts/bench_metrics.py --json                       # last line: {"ratio", ...}
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="train steps per run")
    p.add_argument("--reps", type=int, default=3, help="runs per side, alternating")
    p.add_argument("--sinks", default="jsonl,console,tensorboard,prometheus", help="metrics.sinks of the metrics side")
    p.add_argument("--model", default=None, help="model dir (default: the demo's warm-started model)")
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    return p.parse_args(argv)


def one_run(args, metrics: bool, run_dir: Path) -> float:
    cmd = [sys.executable, "-m", "asyncrl.launch", "--steps", str(args.steps), "--run-dir", str(run_dir)]
    if args.model:
        cmd += ["--model", args.model]
    cmd += [f"metrics.sinks=[{args.sinks}]", "metrics.prometheus_port=0"] if metrics else ["metrics.enabled=false"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    found = re.search(r"took ([0-9.]+) s/step", out.stdout)
    if out.returncode != 0 or not found:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return float(found.group(1))


def main(argv=None) -> int:
    args = parse_args(argv)
    times: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for side in ("off", "on"):
                s = one_run(args, side == "on", Path(tmp) / f"{side}{rep}")
                times[side].append(s)
                print(f"rep {rep} metrics {side:3s}: {s:.4f} s/step", flush=True)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    ratio = on / off
    print(f"median s/step: without metrics {off:.4f}, with ({args.sinks}) {on:.4f}; "
          f"ratio {ratio:.3f} (target <= 1.02)")
    if args.json:
        print(json.dumps({"off_s_per_step": off, "on_s_per_step": on, "ratio": ratio, "runs": times,
                          "steps": args.steps, "sinks": args.sinks}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
