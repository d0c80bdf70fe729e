"""Dynamic sampling on the CPU demo: ``rollout.group_filter=zero_std`` against no filter, per seed.

Runs the launcher's demo (the built-in addition task, the warm-started tiny model, async mode)
once per seed with each filter, side by side, and reports from each run's ``metrics.jsonl``:

- ``t_to_target_s``: training time (the Trainer's ``time_s``, from its first step) until the
  running mean of ``reward_mean`` over ``--window`` steps first reaches ``--target`` (None: never);
- ``gain``: mean reward of the last 20% of steps minus the first 20%;
- ``prompts_per_trained_group``: groups generated per group trained (1 without a filter);
- ``trainer_idle``: the Trainer's time waiting for data over its step time.

    python scripts/bench_filter.py                     # seeds 0-2, 60 steps each way
    python scripts/bench_filter.py --seeds 0 --steps 20 --json

The JSON last line: ``{"runs": [...], "faster_on_every_seed": bool, "speedup_median": ...}``
(``speedup``: no-filter time to target over the filter's, per seed; None where either never got there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learn_sync import learn  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prompts", type=int, default=16, help="groups per step")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--mode", choices=("sync", "async"), default="async")
    p.add_argument("--target", type=float, default=0.6, help="running mean reward to reach")
    p.add_argument("--window", type=int, default=5, help="steps in the running mean")
    p.add_argument("--filters", nargs="+", default=["none", "zero_std"])
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def summarize(rows: list[dict], target: float, window: int) -> dict:
    """The figures of one run's metrics rows (see the module docstring)."""
    rewards = [r["reward_mean"] for r in rows]
    t_hit = None
    for i in range(window - 1, len(rows)):
        if sum(rewards[i - window + 1:i + 1]) / window >= target:
            t_hit = rows[i]["time_s"]
            break
    k = max(1, len(rows) // 5)
    step_s = sum(r["timing_s/step"] for r in rows)
    generated = sum(r["groups"] + r.get("filter/dropped_groups", 0) for r in rows)
    return {"t_to_target_s": t_hit, "gain": sum(rewards[-k:]) / k - sum(rewards[:k]) / k,
            "first_reward": sum(rewards[:k]) / k, "last_reward": sum(rewards[-k:]) / k,
            "prompts_per_trained_group": generated / sum(r["groups"] for r in rows),
            "trainer_idle": sum(r["timing_s/wait_data"] for r in rows) / step_s if step_s else None,
            "train_s": rows[-1]["time_s"]}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    print(f"bench_filter: {args.mode}, {args.steps} steps x {args.prompts} groups x n={args.n}, seeds {args.seeds}, "
          f"filters {args.filters}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores",
          flush=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for f in args.filters:  # side by side: each seed's runs one after the other
                t0 = time.perf_counter()
                rows = learn(args.mode, args.steps, args.prompts, args.n, args.lr, seed, Path(tmp) / f"{f}-{seed}",
                             extra=[f"rollout.group_filter={f}"])
                run = {"seed": seed, "filter": f, "wall_s": time.perf_counter() - t0,
                       **summarize(rows, args.target, args.window)}
                runs.append(run)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in run.items()}), flush=True)
    speedups = []
    for seed in args.seeds:
        base, filt = (next(r for r in runs if r["seed"] == seed and r["filter"] == f) for f in args.filters[:2])
        if base["t_to_target_s"] and filt["t_to_target_s"]:
            speedups.append(base["t_to_target_s"] / filt["t_to_target_s"])
        else:
            speedups.append(None)
    out = {"runs": runs, "speedups": speedups,
           "faster_on_every_seed": all(s is not None and s > 1 for s in speedups),
           "speedup_median": statistics.median(s for s in speedups if s is not None) if any(speedups) else None,
           "load_1m": os.getloadavg()[0]}
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
