"""End to end: time to N train steps, on-policy lockstep (with and without partial rollout) vs fully async
(with and without partial rollout).

Each configuration is one ``python -m asyncrl.launch`` run with the same model (the
warm-started tiny model), seed, ``--n`` and ``--groups-per-step``, on a long-tail response
length workload: the built-in addition task with ``--long-tail 16``. Every prompt carries a
response budget ``6 * 2**k`` tokens with ``P(k) = 0.70, 0.12, 0.09, 0.06, 0.03`` for
``k = 0..4`` (median 6, mean 13.5, at most 96 = 16x the median; drawn once per prompt from
the dataset seed), and the engines do not stop at EOS, so every response really is generated
to its budget (the reward reads the answer before the first EOS). The modes:

- ``sync``: ``--mode sync`` (generate a batch, train, sync; the reference);
- ``sync_partial``: ``--mode sync --partial-rollout true`` (the RFC's workflow: each round keeps
  ``rollout.max_concurrent`` prompts in flight, by default twice the step's, and ends once the
  step has its complete groups; the long tail is truncated and goes on first next step);
  ``--overprovision F`` sets ``max_concurrent = F x groups-per-step`` instead;
- ``async``: ``--mode async --staleness-threshold S`` (in-flight requests paused and kept
  through each weight sync);
- ``async_partial``: the same plus ``--partial-rollout`` (what runs at each weight sync is
  truncated and goes on first at the new weights).

Time is from the end of step 1 to the end of step N + 1 (the launcher's ``time_s``): Ray,
model start-up and the first step (the Rollouter's own start, tens of seconds on a loaded
machine, the same in every mode) are not counted. The modes run interleaved, ``--repeats`` times each, and the
median counts; rewards are the mean sampled reward of the last ``--window`` steps, averaged
over the repeats. Each run also prints where its time went: the Trainer's idle ratio (waiting
for groups) and the engines' (no request in flight), means over the run's metric stream.
With ``--json`` the last line is one JSON object::

    {"sync_s", "sync_partial_s", "async_s", "async_partial_s", "speedup_async",
     "speedup_sync_partial", "partial_vs_async", "reward_sync", "reward_sync_partial",
     "reward_async", "reward_async_partial"}

(``speedup_async`` = sync / async, ``speedup_sync_partial`` = sync / sync_partial,
``partial_vs_async`` = async / async_partial; times are medians over seeds and repeats.)

    python scripts/bench_e2e.py --steps 30 --json
    python scripts/bench_e2e.py --steps 30 --seeds 0 1 2    # rewards over several seeds
    python scripts/bench_e2e.py --modes sync sync_partial --overprovision 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "sync": ["--mode", "sync"],
    "sync_partial": ["--mode", "sync", "--partial-rollout", "true"],
    "async": ["--mode", "async"],
    "async_partial": ["--mode", "async", "--partial-rollout", "true"],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30, help="train steps per run (N)")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--groups-per-step", type=int, default=8, help="prompts per train step")
    p.add_argument("--staleness-threshold", type=float, default=1.0, help="async modes' run-ahead")
    p.add_argument("--long-tail", type=int, default=16, help="longest budget as a multiple of the median")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one set of runs per seed")
    p.add_argument("--repeats", type=int, default=1, help="runs of each mode per seed (median time)")
    p.add_argument("--window", type=int, default=5, help="last steps averaged for the end reward")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="modes to run")
    p.add_argument("--overprovision", type=float, default=None,
                   help="sync_partial: prompts in flight per round as a multiple of groups-per-step (default: the preset, 2)")
    p.add_argument("--model", default=None, help="HF model dir (default: the warm-started tiny model)")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    return p.parse_args()


def run_mode(args: argparse.Namespace, mode: str, seed: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "asyncrl.launch", *MODES[mode], "--steps", str(args.steps + 1), "--n", str(args.n),
           "--groups-per-step", str(args.groups_per_step), "--long-tail", str(args.long_tail),
           "--lr", str(args.lr), "--seed", str(seed), "--run-dir", str(run_dir)]
    if mode == "sync_partial" and args.overprovision is not None:
        cmd += [f"rollout.max_concurrent={max(1, round(args.overprovision * args.groups_per_step))}"]
    if mode.startswith("async"):
        # Room for the run-ahead: as many prompts in flight as the gate may admit.
        ahead = int((1 + args.staleness_threshold) * args.groups_per_step)
        cmd += ["--staleness-threshold", str(args.staleness_threshold), f"rollout.max_concurrent={ahead}"]
    if args.model:
        cmd += ["--model", args.model]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({out.returncode}):\n{(out.stdout + out.stderr)[-3000:]}")
    from asyncrl.metrics.sinks.jsonl import read_events

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The metric stream: the Rollouter's values come on its own poll clock, not per step.
    events = read_events(run_dir / "events.jsonl")
    elapsed = rows[-1]["time_s"] - rows[0]["time_s"]  # steps 2..N+1
    rows = rows[1:]
    w = min(args.window, len(rows))
    return {
        "time_s": elapsed,
        "reward_end": sum(r["reward_mean"] for r in rows[-w:]) / w,
        "reward_start": sum(r["reward_mean"] for r in rows[:w]) / w,
        "len_mean": statistics.mean(r["response_length_mean"] for r in rows),
        "partial_ratio": statistics.mean(r["fully_async/partial/partial_ratio"] for r in rows),
        "staleness": statistics.mean(r["staleness_mean"] for r in rows),
        "trainer_idle": _mean_of(events, "fully_async/trainer/idle_ratio"),
        "engine_idle": _mean_of(events, "fully_async/rollouter/idle_ratio"),
    }


def _mean_of(events: list, name: str) -> float:
    values = [e.value for e in events if e.name == name]
    return statistics.mean(values) if values else float("nan")


def main() -> None:
    args = parse_args()
    from asyncrl.models import default_model_path

    if args.model is None:
        args.model = str(default_model_path())  # build the cached warm start once, outside the timings
    load = os.getloadavg()
    print(f"bench_e2e: {args.steps} steps x {args.groups_per_step} prompts x n={args.n}, long tail x{args.long_tail}, "
          f"seeds {args.seeds}, repeats {args.repeats}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} "
          f"on {os.cpu_count()} cores", flush=True)
    results: dict[str, list[dict]] = {m: [] for m in args.modes}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for rep in range(args.repeats):
                order = list(args.modes) if rep % 2 == 0 else list(reversed(args.modes))  # alternate against drift
                for mode in order:
                    t0 = time.perf_counter()
                    r = run_mode(args, mode, seed, Path(tmp) / f"{mode}-{seed}-{rep}")
                    results[mode].append(r)
                    print(f"  seed {seed} {mode:>13}: {r['time_s']:7.1f} s to step {args.steps}  reward "
                          f"{r['reward_start']:.3f} -> {r['reward_end']:.3f}  len {r['len_mean']:.1f}  "
                          f"partial {r['partial_ratio']:.2f}  "
                          f"staleness {r['staleness']:.2f}  idle: trainer {r['trainer_idle']:.2f} engines "
                          f"{r['engine_idle']:.2f}  (wall {time.perf_counter() - t0:.0f} s)", flush=True)
    med = {m: statistics.median(r["time_s"] for r in rs) for m, rs in results.items()}
    reward = {m: statistics.mean(r["reward_end"] for r in rs) for m, rs in results.items()}
    out = {f"{m}_s": t for m, t in med.items()}
    ratios = {"speedup_async": ("sync", "async", 1.5), "speedup_sync_partial": ("sync", "sync_partial", 1.25),
              "partial_vs_async": ("async", "async_partial", 0.95)}
    for name, (num, den, _) in ratios.items():
        if num in med and den in med:
            out[name] = med[num] / med[den]
    out.update({f"reward_{m}": r for m, r in reward.items()})
    load = os.getloadavg()
    print(f"time to {args.steps} steps (median): " + ", ".join(f"{m} {t:.1f} s" for m, t in med.items()) + "; "
          + ", ".join(f"{name} {out[name]:.2f}x (target {target})" for name, (_, _, target) in ratios.items()
                      if name in out)
          + "; end reward " + ", ".join(f"{m} {r:.3f}" for m, r in reward.items())
          + f"; load average now {load[0]:.1f}", flush=True)
    if args.json:
        print(json.dumps({k: round(v, 4) for k, v in out.items()}))

if __name__ == "__main__":
    main()
