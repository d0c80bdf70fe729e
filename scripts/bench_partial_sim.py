"""Synchronous training with and without partial rollout where a decode step costs the same at
any batch size (a GPU's regime), on simulated engines.

``bench_e2e.py`` measures the two modes end to end on this machine's CPU, where the built-in
engine's decode step costs more the more sequences it holds, so a long tail's nearly empty
steps are cheap and the gain of ending a step early is small. On a GPU a decode step of a small
model costs about the same for 8 sequences as for 128: the steps spent on a long tail are
the waste the partial-rollout RFC removes. This benchmark shows that regime with the real
Rollouter, staleness gate, AggregatorActor, partial buffer and engine actors over
`asyncrl.rollouter.engines.sim.SimEngine` replicas (``max_running`` slots, one token per
running request per step of ``max_running / tokens_per_s`` seconds, whatever the batch), and a
Trainer that takes ``--train-s`` per step (training and the weight sync):

    wait for the step's complete groups -> train (--train-s) -> pause, load version v+1, resume

- ``sync``: ``staleness_threshold=0``, ``max_concurrent`` = the step's prompts (``--mode sync``);
- ``sync_partial``: the RFC's workflow as ``--mode sync --partial-rollout true`` runs it
  (``truncate_at=threshold``, ``max_concurrent`` = ``--overprovision`` x the step's prompts).

The workload is ``bench_e2e.py``'s: every prompt's ``n`` responses run to one budget ``6 * 2**k``
tokens, ``P(k) = 0.70, 0.12, 0.09, 0.06, 0.03`` (median 6, at most 96). Time counts from the
end of step 1 to the end of step N + 1. With ``--json`` the last line is
``{"sync_s", "sync_partial_s", "speedup_sync_partial", "token_lag_sync_partial"}``
(``token_lag``: mean versions between a trained token's sampling and the step that trains it).

    python scripts/bench_partial_sim.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import numpy as np

from asyncrl.queue.memory import MemorySink
from asyncrl.rollouter.actor import EngineActor
from asyncrl.rollouter.aggregator import AggregatorActor
from asyncrl.rollouter.partial import PartialRolloutConfig
from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
from asyncrl.tasks.arithmetic import long_tail_budget


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="train steps timed (N)")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--groups-per-step", type=int, default=8, help="prompts per train step")
    p.add_argument("--replicas", type=int, default=2, help="simulated engine replicas")
    p.add_argument("--max-running", type=int, default=128, help="slots per replica")
    p.add_argument("--step-ms", type=float, default=10.0, help="one decode step of a replica, at any batch")
    p.add_argument("--train-s", type=float, default=0.1, help="a train step plus its weight sync")
    p.add_argument("--overprovision", type=float, default=2.0, help="sync_partial: prompts in flight per step's prompts")
    p.add_argument("--max-age", type=int, default=4, help="partial_rollout.max_age")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    return p.parse_args()


def prompts(seed: int, count: int = 4000) -> list[Prompt]:
    rng = np.random.default_rng(seed)
    return [Prompt(text=f"p{i}", prompt_ids=np.array([1, 4 + i % 50, 5], dtype=np.int64),
                   max_tokens=long_tail_budget(rng, 6, 16)) for i in range(count)]


async def run(args: argparse.Namespace, mode: str, seed: int) -> dict:
    g, n = args.groups_per_step, args.n
    # Every drawn length is past every budget, so each response runs to its prompt's budget.
    engines = [EngineActor(kind="sim", max_running=args.max_running, tokens_per_s=args.max_running / args.step_ms * 1e3,
                           median_tokens=96, long_tail=1, seed=seed + r) for r in range(args.replicas)]
    sink = MemorySink()
    if mode == "sync":
        cfg = RolloutConfig(n=n, max_tokens=96, groups_per_sync=g, staleness_threshold=0.0, max_concurrent=g,
                            seed=seed)
        rollouter = Rollouter(cfg, engines, sink, prompts(seed), lambda p, ids: 0.0)
    else:
        cfg = RolloutConfig(n=n, max_tokens=96, groups_per_sync=g, staleness_threshold=0.0, seed=seed,
                            max_concurrent=max(1, round(args.overprovision * g)))
        rollouter = Rollouter(cfg, engines, sink, prompts(seed), lambda p, ids: 0.0,
                              partial=PartialRolloutConfig(enable=True, truncate_at="threshold", max_age=args.max_age),
                              aggregator=AggregatorActor(engines, None))
    task = asyncio.create_task(rollouter.run())
    lags, start = [], 0.0
    try:
        for version in range(1, args.steps + 2):
            while len([x for x in sink.groups if x.complete]) < version * g:
                if task.done():
                    await task
                await asyncio.sleep(0.001)
            step = [x for x in sink.groups if x.complete][(version - 1) * g:version * g]
            lags += [version - 1 - int(v) for x in step for t in x.trajectories for v in t.versions]
            if version == 1:
                start = time.monotonic()
            await asyncio.sleep(args.train_s)
            await rollouter.on_pause()
            for e in engines:
                await e.pause("keep")
                await e.finish_weight_update(version)
                await e.resume()
            await rollouter.on_sync(version)
        elapsed = time.monotonic() - start - args.train_s  # to the end of step N + 1's generation
    finally:
        await rollouter.stop()
        await asyncio.gather(task, return_exceptions=True)
        for e in engines:
            await e.close()
    return {"time_s": elapsed, "token_lag": float(np.mean(lags)), "truncated": rollouter.stats.truncated}


def main() -> None:
    args = parse_args()
    load = os.getloadavg()
    print(f"bench_partial_sim: {args.steps} steps x {args.groups_per_step} prompts x n={args.n}, {args.replicas} "
          f"replicas x {args.max_running} slots, decode step {args.step_ms} ms at any batch, train {args.train_s} s; "
          f"load average {load[0]:.1f}", flush=True)
    results: dict[str, list[dict]] = {"sync": [], "sync_partial": []}
    for seed in args.seeds:
        for mode in results if seed % 2 == 0 else reversed(results):
            r = asyncio.run(run(args, mode, seed))
            results[mode].append(r)
            print(f"  seed {seed} {mode:>12}: {r['time_s']:6.2f} s to step {args.steps}  token lag "
                  f"{r['token_lag']:.2f}  truncated {r['truncated']}", flush=True)
    med = {m: statistics.median(r["time_s"] for r in rs) for m, rs in results.items()}
    out = {"sync_s": med["sync"], "sync_partial_s": med["sync_partial"],
           "speedup_sync_partial": med["sync"] / med["sync_partial"],
           "token_lag_sync_partial": statistics.mean(r["token_lag"] for r in results["sync_partial"])}
    print(f"time to {args.steps} steps (median): sync {med['sync']:.2f} s, sync_partial {med['sync_partial']:.2f} s; "
          f"speedup {out['speedup_sync_partial']:.2f}x; load average now {os.getloadavg()[0]:.1f}", flush=True)
    if args.json:
        print(json.dumps({k: round(v, 4) for k, v in out.items()}))


if __name__ == "__main__":
    main()
