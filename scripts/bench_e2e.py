"""End to end: time to N train steps, on-policy lockstep (with and without partial rollout) vs fully async
(with and without partial rollout), and whether each mode learns.

Each configuration is one ``python -m asyncrl.launch`` run with the same model (the
warm-started tiny model), seed, ``--n``, ``--groups-per-step`` and ``--lr``, on a long-tail response
length workload: the built-in addition task with ``--long-tail 16``. Every prompt carries a
response budget ``6 * 2**k`` tokens with ``P(k) = 0.70, 0.12, 0.09, 0.06, 0.03`` for
``k = 0..4`` (median 6, mean 13.5, at most 96 = 16x the median; drawn once per prompt from
the dataset seed), and the engines do not stop at EOS, so every response really is generated
to its budget (the reward reads the answer before the first EOS). The modes:

- ``sync``: ``--mode sync`` (generate a batch, train, sync; the reference);
- ``async``: ``--mode async --staleness-threshold S`` (in-flight requests paused and kept
  through each weight sync);
- ``sync_partial`` (not run unless named in ``--modes``): ``--mode sync --partial-rollout true``
  (the RFC's workflow: each round keeps ``rollout.max_concurrent`` prompts in flight, by default
  twice the step's, and ends once the step has its complete groups; the long tail is truncated
  and goes on first next step); ``--overprovision F`` sets ``max_concurrent = F x groups-per-step``;
- ``async_partial`` (likewise): the same as ``async`` plus ``--partial-rollout`` (what runs at each
  weight sync is truncated and goes on first at the new weights).

Time is from the end of step 1 to the end of step N + 1 (the launcher's ``time_s``): Ray,
model start-up and the first step (the same in every mode) are not counted. For every seed the
modes run ``--repeats`` times interleaved, the order reversed every other repeat (sync, async,
async, sync, ...) so that a drift in the machine's load falls on both. A ratio such as
``speedup_async`` is taken per (seed, repeat) between the two runs made side by side, and the
median of those ratios counts, with their min and max as the spread. A mode *learns* on a seed
when its mean sampled reward over the last ``--window`` steps is above that over the first
``--window`` (each averaged over the repeats); its end reward is the mean over seeds of that
last-window reward. Each run also prints where its time went: the steps' ``bound`` side (the
launcher's step line, `asyncrl.progress.bound_side`), and per step the Trainer's wait for groups,
its update and the weight sync (``timing_s/param_sync``: pause, transfer, resume).

``--lr`` is the same for every mode; choose one at which sync learns too: sync trains each batch
once on the weights that sampled it (importance ratio 1, PPO's clip idle), so it takes every
step in full, while async's clip damps its steps on groups a version old and tolerates more
(``docs/bench_e2e.md``).

With ``--json`` the last line is one JSON object: ``{mode}_s`` (median time), ``reward_{mode}``,
``learned_{mode}`` (one bool per seed), and for each ratio of two modes run (``speedup_async`` =
sync / async, ``speedup_sync_partial`` = sync / sync_partial, ``partial_vs_async`` = async /
async_partial) the median and ``{ratio}_min``, ``{ratio}_max``; ``reward_gap_async`` = |async - sync|
end reward; ``bound_{mode}`` (steps per bound side); ``load_1m`` (before, after).

    python scripts/bench_e2e.py --json                        # sync vs async, seeds 0 1 2 x 3 repeats
    python scripts/bench_e2e.py --modes sync sync_partial --overprovision 3 --repeats 1
"""

from __future__ import annotations

import argparse
import collections
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
RATIOS = {"speedup_async": ("sync", "async", 1.5), "speedup_sync_partial": ("sync", "sync_partial", 1.25),
          "partial_vs_async": ("async", "async_partial", 0.95)}
"""name: (numerator mode, denominator mode, target)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="train steps per run (N; at 30, seed 2 learns in neither mode)")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--groups-per-step", type=int, default=8, help="prompts per train step")
    p.add_argument("--staleness-threshold", type=float, default=1.0, help="async modes' run-ahead")
    p.add_argument("--long-tail", type=int, default=16, help="longest budget as a multiple of the median")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="learning rate of every mode (2e-3, the former default, is too high for sync: docs/bench_e2e.md)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one set of runs per seed")
    p.add_argument("--repeats", type=int, default=3, help="runs of each mode per seed")
    p.add_argument("--window", type=int, default=5, help="first/last steps averaged for the start/end reward")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["sync", "async"], help="modes to run")
    p.add_argument("--overprovision", type=float, default=None,
                   help="sync_partial: prompts in flight per round as a multiple of groups-per-step (default: the preset, 2)")
    p.add_argument("--model", default=None, help="HF model dir (default: the warm-started tiny model)")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = p.parse_args(argv)
    if args.steps < 2 * args.window:
        p.error(f"--steps {args.steps} must be at least 2 x --window {args.window}: the start and end rewards "
                "are averaged over disjoint windows")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def launch_command(args: argparse.Namespace, mode: str, seed: int, run_dir: Path) -> list[str]:
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
    return cmd


def run_mode(args: argparse.Namespace, mode: str, seed: int, run_dir: Path) -> dict:
    """One launcher run; its time to step N + 1 from step 1, rewards and where its time went."""
    out = subprocess.run(launch_command(args, mode, seed, run_dir), cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"{mode} run failed ({out.returncode}):\n{(out.stdout + out.stderr)[-3000:]}")
    from asyncrl.metrics.sinks.jsonl import read_events
    from asyncrl.progress import bound_side

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The metric stream: the Rollouter's values come on its own poll clock, not per step.
    events = read_events(run_dir / "events.jsonl")
    elapsed = rows[-1]["time_s"] - rows[0]["time_s"]  # steps 2..N+1
    rows = rows[1:]
    w = min(args.window, len(rows))
    return {
        "seed": seed,
        "time_s": elapsed,
        "reward_end": statistics.mean(r["reward_mean"] for r in rows[-w:]),
        "reward_start": statistics.mean(r["reward_mean"] for r in rows[:w]),
        "len_mean": statistics.mean(r["response_length_mean"] for r in rows),
        "partial_ratio": statistics.mean(r["fully_async/partial/partial_ratio"] for r in rows),
        "staleness": statistics.mean(r["staleness_mean"] for r in rows),
        "clip_frac": statistics.mean(r["clip_frac"] for r in rows),
        "bound": dict(collections.Counter(bound_side(r) or "unknown" for r in rows)),
        "wait_s": statistics.mean(r["timing_s/wait_data"] for r in rows),
        "update_s": statistics.mean(r["timing_s/update_actor"] for r in rows),
        "param_sync_s": _mean_of(events, "timing_s/param_sync"),
        "trainer_idle": _mean_of(events, "fully_async/trainer/idle_ratio"),
        "engine_idle": _mean_of(events, "fully_async/rollouter/idle_ratio"),
    }


def _mean_of(events: list, name: str) -> float:
    values = [e.value for e in events if e.name == name]
    return statistics.mean(values) if values else float("nan")


def summarize(results: dict[str, list[dict]]) -> dict:
    """The JSON figures from each mode's runs, listed in the same (seed, repeat) order for every mode."""
    out: dict = {f"{m}_s": statistics.median(r["time_s"] for r in rs) for m, rs in results.items()}
    for name, (num, den, _) in RATIOS.items():
        if num in results and den in results:
            # Paired: the two runs of one (seed, repeat) ran side by side, under the same load.
            ratios = [a["time_s"] / b["time_s"] for a, b in zip(results[num], results[den], strict=True)]
            out.update({name: statistics.median(ratios), f"{name}_min": min(ratios), f"{name}_max": max(ratios)})
    for m, rs in results.items():
        by_seed = collections.defaultdict(list)
        for r in rs:
            by_seed[r["seed"]].append(r)
        start = {s: statistics.mean(r["reward_start"] for r in runs) for s, runs in by_seed.items()}
        end = {s: statistics.mean(r["reward_end"] for r in runs) for s, runs in by_seed.items()}
        out[f"reward_{m}"] = statistics.mean(end.values())
        out[f"learned_{m}"] = [end[s] > start[s] for s in by_seed]
        out[f"bound_{m}"] = dict(sum((collections.Counter(r["bound"]) for r in rs), collections.Counter()))
    if "sync" in results and "async" in results:
        out["reward_gap_async"] = abs(out["reward_async"] - out["reward_sync"])
    return out


def _run_line(seed: int, mode: str, r: dict, steps: int, wall_s: float) -> str:
    bound = " ".join(f"{side} {count}" for side, count in sorted(r["bound"].items()))
    return (f"  seed {seed} {mode:>13}: {r['time_s']:7.1f} s to step {steps}  reward {r['reward_start']:.3f} -> "
            f"{r['reward_end']:.3f}  len {r['len_mean']:.1f}  staleness {r['staleness']:.2f}  clip "
            f"{r['clip_frac']:.3f}  partial {r['partial_ratio']:.2f}  per step: wait {r['wait_s']:.3f} s, update "
            f"{r['update_s']:.3f} s, sync {r['param_sync_s']:.3f} s  bound: {bound}  idle: trainer "
            f"{r['trainer_idle']:.2f} engines {r['engine_idle']:.2f}  (wall {wall_s:.0f} s)")


def _summary_line(out: dict, modes: list[str], steps: int) -> str:
    parts = [f"time to {steps} steps (median): " + ", ".join(f"{m} {out[f'{m}_s']:.1f} s" for m in modes)]
    for name, (_, _, target) in RATIOS.items():
        if name in out:
            parts.append(f"{name} {out[name]:.2f}x ({out[f'{name}_min']:.2f}-{out[f'{name}_max']:.2f}, "
                         f"target {target})")
    parts.append("end reward " + ", ".join(f"{m} {out[f'reward_{m}']:.3f}" for m in modes))
    parts.append("learned per seed " + ", ".join(f"{m} {out[f'learned_{m}']}" for m in modes))
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from asyncrl.models import default_model_path

    if args.model is None:
        args.model = str(default_model_path())  # build the cached warm start once, outside the timings
    load_before = os.getloadavg()[0]
    print(f"bench_e2e: {args.steps} steps x {args.groups_per_step} prompts x n={args.n}, long tail x{args.long_tail}, "
          f"lr {args.lr}, seeds {args.seeds}, repeats {args.repeats}; load average {load_before:.1f} on "
          f"{os.cpu_count()} cores", flush=True)
    results: dict[str, list[dict]] = {m: [] for m in args.modes}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for rep in range(args.repeats):
                order = list(args.modes) if rep % 2 == 0 else list(reversed(args.modes))  # alternate against drift
                for mode in order:
                    t0 = time.perf_counter()
                    r = run_mode(args, mode, seed, Path(tmp) / f"{mode}-{seed}-{rep}")
                    results[mode].append(r)
                    print(_run_line(seed, mode, r, args.steps, time.perf_counter() - t0), flush=True)
    out = summarize(results)
    out["load_1m"] = [load_before, os.getloadavg()[0]]
    print(_summary_line(out, args.modes, args.steps) + f"; load average {out['load_1m'][0]:.1f} -> "
          f"{out['load_1m'][1]:.1f}", flush=True)
    if args.json:
        print(json.dumps(_rounded(out)))
    return out


def _rounded(value):
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


if __name__ == "__main__":
    main()
