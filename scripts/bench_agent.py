"""Agent loops where tool latency is the tail, on a workload whose reward rises in every mode:
`--mode sync`, `--mode sync --partial-rollout true` and `--mode async`, per seed, side by side.

The workload (``--workload calculator``, the default): the built-in calculator task
(`asyncrl.tasks.calculator`, its shipped warm-started model, lr 5e-5) with the calculator's
latency log-normal, median ``--tool-median-s`` (0.2 s) and p99 ``--tool-p99-s`` (2 s). The
policy learns to call the tool (the sampled reward climbs ~+0.3 in 60 steps), so the question
is how soon each mode gets there in wall time:

- **time to reward**: per run, the start reward is the mean over the first ``--window`` steps
  after step 1, and the time to reward is the wall time from the end of step 1 until the running
  mean of the last ``--window`` steps' rewards first reaches start + ``--rise`` (0.15);
  ``time_ratio_{mode}`` is mode / sync, the median of the per-seed ratios (runs of one seed go
  back to back, the order alternating); targets: async <= 0.5, sync_partial <= 0.8, each mode's
  end reward within 0.05 of sync's and above its own start by >= 0.15;
- **per step**, as before: time from step 1 to step N + 1 and ``speedup_{mode}`` = sync / mode
  (`bench_e2e.py`'s timing and pairing).

``--agent openai`` trains the same task through the OpenAI-compatible endpoint instead: the plain
``openai`` loop of ``examples/openai_agent`` with the calculator on the client's side, its latency
drawn from the same log-normal (``CALCULATOR_LATENCY_*``). ``--workload addition`` is the former
workload (``bench_agent_env.SlowToolEnv``: the addition task, 2-4 turns; no mode's reward rose in
20 steps there, so it times steps only). ``--runs-dir DIR`` keeps every run directory
(``DIR/{mode}-seed{seed}``) for ``scripts/plot_bench_agent.py --from DIR``.

JSON last line: ``time_to_reward_s``, ``reward_start``, ``reward_end`` (each ``{mode: mean over
seeds}``; a mode that never reached the rise on a seed has null there and counts in
``reached``), ``time_ratio_async``, ``time_ratio_sync_partial``, ``reward_gap_{mode}``,
``sync_s``, ``sync_partial_s``, ``async_s``, ``speedup_async``, ``speedup_sync_partial`` (with
their min/max), ``tool_calls_per_s`` (async), ``turns_mean_{mode}``, ``agent``, ``load_1m``.

    python scripts/bench_agent.py --json --runs-dir runs/bench_agent           # seeds 0 1 2, 60 steps
    python scripts/bench_agent.py --json --agent openai --runs-dir runs/bench_agent_openai
    python scripts/bench_agent.py --seeds 0 --steps 12                         # a quick look
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import bench_e2e  # noqa: E402

SPEEDUPS = {"speedup_async": ("sync", "async", 2.0), "speedup_sync_partial": ("sync", "sync_partial", 1.25)}
"""Per-step speed-ups (sync time / mode time) and their targets, as before."""
TIME_RATIOS = {"time_ratio_async": ("async", 0.5), "time_ratio_sync_partial": ("sync_partial", 0.8)}
"""Time to reward, mode / sync, and the target it must be at most."""
REWARD_GAP = 0.05
AGENTS = {"openai": "rollout.agent.function=examples.openai_agent.agent:run"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("calculator", "addition"), default="calculator")
    p.add_argument("--agent", choices=sorted(AGENTS), default=None, help="run through the endpoint with this stack")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=16)
    p.add_argument("--lr", type=float, default=None, help="default: the workload's (5e-5 calculator, 1e-3 addition)")
    p.add_argument("--staleness-threshold", type=float, default=1.0)
    p.add_argument("--modes", nargs="+", default=["sync", "sync_partial", "async"], choices=list(bench_e2e.MODES))
    p.add_argument("--tool-median-s", type=float, default=0.2)
    p.add_argument("--tool-p99-s", type=float, default=2.0)
    p.add_argument("--max-turns", type=int, default=4, help="addition workload: most turns per conversation")
    p.add_argument("--window", type=int, default=5, help="steps in the start reward and the running mean")
    p.add_argument("--rise", type=float, default=0.15, help="reward above the start that ends the time to reward")
    p.add_argument("--runs-dir", type=Path, default=None, help="keep the run directories here")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.agent and args.workload != "calculator":
        p.error("--agent runs the calculator workload (the examples' agents use the calculator)")
    if args.lr is None:
        args.lr = 5e-5 if args.workload == "calculator" else 1e-3
    if args.steps < 2 * args.window:
        p.error(f"--steps {args.steps} must be at least 2 x --window {args.window}")
    args.repeats, args.long_tail, args.overprovision, args.model = 1, 1, None, None  # what bench_e2e reads
    return args


def workload_overrides(args: argparse.Namespace) -> list[str]:
    """The launcher arguments that make the workload (after the mode's and the run's)."""
    if args.workload == "addition":
        return ["--long-tail", "1", "rollout.agent.env=bench_agent_env:SlowToolEnv",
                f"rollout.agent.max_turns={args.max_turns}", "rollout.agent.max_tokens_per_turn=6",
                f"rollout.agent.tool_concurrency={args.n * args.groups_per_step * 2}"]
    if args.agent:  # the tool runs in the agent, which reads its latency from the environment
        return [AGENTS[args.agent]]
    return ["--task", "calculator", f"rollout.agent.kwargs.latency_median_s={args.tool_median_s}",
            f"rollout.agent.kwargs.latency_p99_s={args.tool_p99_s}"]


def launch_command(args: argparse.Namespace, mode: str, seed: int, run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "asyncrl.launch", *bench_e2e.MODES[mode], "--steps", str(args.steps + 1),
           "--n", str(args.n), "--groups-per-step", str(args.groups_per_step), "--lr", str(args.lr),
           "--seed", str(seed), "--run-dir", str(run_dir), "max_restarts=0"]
    if args.agent:
        cmd += ["--task", "calculator"]
    if mode.startswith("async"):  # room for the run-ahead: as many prompts in flight as the gate may admit
        ahead = int((1 + args.staleness_threshold) * args.groups_per_step)
        cmd += ["--staleness-threshold", str(args.staleness_threshold), f"rollout.max_concurrent={ahead}"]
    return cmd + workload_overrides(args)


def time_to_reward(rows: list[dict], window: int, rise: float) -> dict:
    """From a run's metrics rows (step 1 first): the start and end reward (means of the first and
    last ``window`` steps after step 1) and the wall time from step 1's end until the running mean
    of ``window`` steps first reaches start + ``rise`` (None: never)."""
    t0, rows = rows[0]["time_s"], rows[1:]
    rewards = [r["reward_mean"] for r in rows]
    w = max(1, min(window, len(rows)))
    start, end = statistics.mean(rewards[:w]), statistics.mean(rewards[-w:])
    reached = next((rows[k]["time_s"] - t0 for k in range(w - 1, len(rows))
                    if statistics.mean(rewards[k - w + 1:k + 1]) >= start + rise), None)
    return {"time_to_reward_s": reached, "reward_start": start, "reward_end": end}


def summarize_reward(per_run: dict[str, list[dict]]) -> dict:
    """The time-to-reward figures of the modes' runs (listed in the same seed order for each mode)."""
    out: dict = {"time_to_reward_s": {}, "reward_start": {}, "reward_end": {}, "reached": {}}
    for m, runs in per_run.items():
        times = [r["time_to_reward_s"] for r in runs if r["time_to_reward_s"] is not None]
        out["time_to_reward_s"][m] = statistics.median(times) if times else None
        out["reward_start"][m] = statistics.mean(r["reward_start"] for r in runs)
        out["reward_end"][m] = statistics.mean(r["reward_end"] for r in runs)
        out["reached"][m] = f"{len(times)}/{len(runs)}"
    for name, (mode, _) in TIME_RATIOS.items():
        if mode in per_run and "sync" in per_run:
            ratios = [a["time_to_reward_s"] / s["time_to_reward_s"] for a, s in zip(per_run[mode], per_run["sync"],
                                                                                       strict=True)
                      if a["time_to_reward_s"] is not None and s["time_to_reward_s"]]
            out[name] = statistics.median(ratios) if ratios else None
    for m in per_run:
        if m != "sync" and "sync" in per_run:
            out[f"reward_gap_{m}"] = abs(out["reward_end"][m] - out["reward_end"]["sync"])
    return out


def verdicts(out: dict, rise: float) -> list[str]:
    said = []
    for name, (_, target) in TIME_RATIOS.items():
        if out.get(name) is not None:
            said.append(f"{name} {out[name]:.2f} (target <= {target}: {'met' if out[name] <= target else 'missed'})")
    for name, (_, _, target) in SPEEDUPS.items():
        if name in out:
            said.append(f"{name} {out[name]:.2f}x (target >= {target})")
    for m, end in out["reward_end"].items():
        gain = end - out["reward_start"][m]
        said.append(f"{m} reward {out['reward_start'][m]:.3f} -> {end:.3f} (rise {gain:+.3f}, target >= {rise}: "
                    f"{'met' if gain >= rise else 'missed'})")
        if f"reward_gap_{m}" in out:
            gap = out[f"reward_gap_{m}"]
            said.append(f"reward gap {m} {gap:.3f} (target <= {REWARD_GAP}: {'met' if gap <= REWARD_GAP else 'missed'})")
    return said


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.update({"ASYNCRL_BENCH_TOOL_MEDIAN_S": str(args.tool_median_s),  # the addition workload's env
                       "ASYNCRL_BENCH_TOOL_P99_S": str(args.tool_p99_s),
                       "CALCULATOR_LATENCY_MEDIAN_S": str(args.tool_median_s),  # the examples' client-side tool
                       "CALCULATOR_LATENCY_P99_S": str(args.tool_p99_s)})
    # The launcher, its Ray workers and the Rollouter import the env or agent from these folders.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(ROOT), os.environ.get("PYTHONPATH")]))
    bench_e2e.launch_command = launch_command
    bench_e2e.RATIOS = SPEEDUPS
    load_before = os.getloadavg()[0]
    print(f"bench_agent: {args.workload} workload{' through the endpoint (' + args.agent + ')' if args.agent else ''}, "
          f"tool latency median {args.tool_median_s} s, p99 {args.tool_p99_s} s; {args.steps} steps x "
          f"{args.groups_per_step} prompts x n={args.n}, lr {args.lr}, seeds {args.seeds}; load {load_before:.1f}",
          flush=True)
    results: dict[str, list[dict]] = {m: [] for m in args.modes}
    reward_runs: dict[str, list[dict]] = {m: [] for m in args.modes}
    turns: dict[str, list[float]] = {m: [] for m in args.modes}
    tool_rate: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        runs_dir = args.runs_dir or Path(tmp)
        for i, seed in enumerate(args.seeds):
            for mode in (args.modes if i % 2 == 0 else list(reversed(args.modes))):  # alternate against drift
                t0, run_dir = time.perf_counter(), runs_dir / f"{mode}-seed{seed}"
                r = bench_e2e.run_mode(args, mode, seed, run_dir)
                rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                reward = time_to_reward(rows, args.window, args.rise)
                results[mode].append(r)
                reward_runs[mode].append(reward)
                _count_tools(rows[1:], mode, r, args, turns, tool_rate)
                reached = reward["time_to_reward_s"]
                print(bench_e2e._run_line(seed, mode, r, args.steps, time.perf_counter() - t0)
                      + f"  time to reward +{args.rise}: " + (f"{reached:.1f} s" if reached is not None else "never"),
                      flush=True)
    out = {**bench_e2e.summarize(results), **summarize_reward(reward_runs), "agent": args.agent or "env",
           "workload": args.workload}
    for m in args.modes:
        if turns[m]:
            out[f"turns_mean_{m}"] = statistics.mean(turns[m])
    if tool_rate:
        out["tool_calls_per_s"] = statistics.median(tool_rate)
    out["load_1m"] = [load_before, os.getloadavg()[0]]
    print("bench_agent: " + "; ".join(verdicts(out, args.rise)), flush=True)
    if args.json:
        print(json.dumps(bench_e2e._rounded(out)))
    return out


def _count_tools(rows: list[dict], mode: str, r: dict, args: argparse.Namespace, turns: dict, tool_rate: list) -> None:
    """Turns per conversation (every mode) and tool calls per second (async), where the run counts them."""
    if rows and "agent/turns_mean" in rows[0]:
        turns[mode].append(statistics.mean(x["agent/turns_mean"] for x in rows))
    if mode == "async" and rows and "agent/step_tool_calls" in rows[0]:
        tool_rate.append(sum(x["agent/step_tool_calls"] for x in rows) / r["time_s"])


if __name__ == "__main__":
    main()
