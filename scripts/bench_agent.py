"""Agent loops where tool latency is the tail: `--mode sync`, `--mode sync --partial-rollout true`
and `--mode async` on the same multi-turn workload, per seed, side by side.

The workload (`bench_agent_env.SlowToolEnv`): the CPU demo's addition task and warm-started tiny
model, each response a conversation of 2-4 model turns with a tool call between turns whose
latency is log-normal, median ``--tool-median-s`` (0.2 s) and p99 ``--tool-p99-s`` (2 s). The
reward scores the last turn's answer, so every mode learns what the demo learns; a step's wall
time is mostly tool time, which generation and training can fill in async mode.

Timing, pairing and the learning check are `bench_e2e.py`'s: time from step 1 to step N + 1,
the modes of one (seed, repeat) run back to back in alternating order, each ratio the median of
the per-pair ratios with min and max. JSON last line: ``sync_s``, ``sync_partial_s``, ``async_s``,
``speedup_async`` (sync / async, target >= 2.0), ``speedup_sync_partial`` (target >= 1.25),
``reward_{mode}`` and ``reward_gap_{mode}`` (|mode - sync| end reward, target <= 0.05),
``tool_calls_per_s`` (async), ``turn_prefill_tokens_per_turn`` and ``turn_prompt_tokens_per_turn``
(async: prompt tokens a turn's request computed, against those it carried; equal means the
conversation so far was prefilled again), ``turns_mean`` per mode, ``load_1m``.

    python scripts/bench_agent.py --json                  # seeds 0 1 2, 30 steps, one repeat
    python scripts/bench_agent.py --seeds 0 --steps 12    # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_e2e  # noqa: E402

TARGETS = {"speedup_async": ("sync", "async", 2.0), "speedup_sync_partial": ("sync", "sync_partial", 1.25)}
REWARD_GAP = 0.05


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--staleness-threshold", type=float, default=1.0)
    p.add_argument("--modes", nargs="+", default=["sync", "sync_partial", "async"], choices=list(bench_e2e.MODES))
    p.add_argument("--tool-median-s", type=float, default=0.2)
    p.add_argument("--tool-p99-s", type=float, default=2.0)
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    e2e = ["--steps", str(args.steps), "--seeds", *map(str, args.seeds), "--repeats", str(args.repeats), "--n",
           str(args.n), "--groups-per-step", str(args.groups_per_step), "--lr", str(args.lr), "--long-tail", "1",
           "--staleness-threshold", str(args.staleness_threshold), "--modes", *args.modes]
    return args, e2e


def main(argv: list[str] | None = None) -> dict:
    args, e2e_argv = parse_args(argv)
    os.environ["ASYNCRL_BENCH_TOOL_MEDIAN_S"] = str(args.tool_median_s)
    os.environ["ASYNCRL_BENCH_TOOL_P99_S"] = str(args.tool_p99_s)
    # The launcher, its Ray workers and the Rollouter import the env from this folder.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    agent = ["rollout.agent.env=bench_agent_env:SlowToolEnv", f"rollout.agent.max_turns={args.max_turns}",
             "rollout.agent.max_tokens_per_turn=6", f"rollout.agent.tool_concurrency={args.n * args.groups_per_step * 2}"]
    plain = bench_e2e.launch_command
    bench_e2e.launch_command = lambda a, mode, seed, run_dir: plain(a, mode, seed, run_dir) + agent
    bench_e2e.RATIOS = TARGETS
    turns: dict[str, list[float]] = {m: [] for m in args.modes}
    tool_rate: list[float] = []
    prefill: dict[str, list[float]] = {"prefill": [], "prompt": []}
    run_mode = bench_e2e.run_mode

    def run_and_count(a, mode, seed, run_dir):
        r = run_mode(a, mode, seed, run_dir)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
        if rows and "agent/turns_mean" in rows[0]:
            turns[mode].append(statistics.mean(x["agent/turns_mean"] for x in rows))
            if mode == "async":
                calls = sum((x["agent/turns_mean"] - 1) * x["groups"] * a.n for x in rows)
                tool_rate.append(calls / r["time_s"])
                # Each turn is one engine call: the engine's per-call means are per turn here.
                for key in ("prefill", "prompt"):
                    got = [x[f"engine/{key}_tokens_per_group"] for x in rows if f"engine/{key}_tokens_per_group" in x]
                    if got:
                        prefill[key].append(statistics.mean(got))
        return r

    bench_e2e.run_mode = run_and_count
    print(f"bench_agent: tool latency median {args.tool_median_s} s, p99 {args.tool_p99_s} s, 2-4 turns per "
          f"conversation (at most {args.max_turns})", flush=True)
    out = bench_e2e.main(e2e_argv)
    for m in args.modes:
        if m != "sync" and f"reward_{m}" in out and "reward_sync" in out:
            out[f"reward_gap_{m}"] = abs(out[f"reward_{m}"] - out["reward_sync"])
        if turns[m]:
            out[f"turns_mean_{m}"] = statistics.mean(turns[m])
    if tool_rate:
        out["tool_calls_per_s"] = statistics.median(tool_rate)
    if prefill["prefill"]:
        out["turn_prefill_tokens_per_turn"] = statistics.median(prefill["prefill"])
        out["turn_prompt_tokens_per_turn"] = statistics.median(prefill["prompt"])
    verdicts = [f"{name} {out[name]:.2f}x (target >= {target}: {'met' if out[name] >= target else 'missed'})"
                for name, (_, _, target) in TARGETS.items() if name in out]
    verdicts += [f"reward gap {m} {out[f'reward_gap_{m}']:.3f} (target <= {REWARD_GAP}: "
                 f"{'met' if out[f'reward_gap_{m}'] <= REWARD_GAP else 'missed'})"
                 for m in args.modes if f"reward_gap_{m}" in out]
    print("bench_agent: " + "; ".join(verdicts), flush=True)
    if args.json:
        print(json.dumps(bench_e2e._rounded(out)))
    return out


if __name__ == "__main__":
    main()
