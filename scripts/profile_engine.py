"""Where the built-in engine's time goes on a `bench_engine` workload.

Runs the engine once untimed (warm-up), then ``--repeats`` times (default 5) with wall-clock
timers wrapped around the parts of a step, and prints each run and, per part, the median over
the runs of its time per step and its share of the run:

- ``forward (with prompts)`` / ``forward (decode only)``: the model forwards of steps that
  prefill admitted requests and of pure decode steps (ids and positions built), excluding the
  pieces below;
- ``kv write + read``: `PagedKVCache.update` (per layer: the new keys/values into their
  slots, the rows' cache gathered through their block tables);
- ``masks + block tables``: `step_masks` and the forward's slot indices (`PagedKVCache.begin`,
  block copies and pool growth included);
- ``sampling``: `sample_tokens` (log-softmax, greedy argmax or seeded draws, log-probs);
- ``plan (blocks)``: `ModelRunner.plan` (blocks of finished requests freed, new ones
  allocated, shared prompts forked);
- ``step bookkeeping``: tokens, log-probs and versions appended, ends checked, counters, the
  logits of shared prompts' followers (in the worker thread);
- ``event loop + thread hops``: the rest of the wall time (admission, finishing requests,
  waking the worker thread and then the event loop for each run of steps, asyncio). Where the
  engine predates runs of steps (one hop per step, bookkeeping on the loop), step bookkeeping
  is counted here.

It also prints the runs of steps the worker thread made (thread hops), the process's CPU
time per step (less sensitive to other load than wall time) and the 1-minute load average
before and after.

``--workload short`` profiles bench_engine's short-response workload (a 4-layer Qwen2, 8
prompts x n=8, 64 slots, seeded temperature-1 sampling as in an RL run) instead of the
long-tail one (bench_engine's 2-layer model with 2 query heads of 32 over one key/value head,
greedy).

The timers add a few microseconds per call; the shares, not the absolute times, are the point.

    PYTHONPATH=. python scripts/profile_engine.py [--workload short] [--median 12] [--slots 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--median", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", choices=("longtail", "short"), default="longtail")
    p.add_argument("--repeats", type=int, default=5, help="timed runs (after one warm-up); medians are printed")
    return p.parse_args(argv)


def timed(totals, key, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    return wrapper


def main(argv=None) -> int:
    args = parse_args(argv)
    import asyncio

    import torch

    torch.set_num_threads(args.threads)
    from asyncrl.models.tiny import build_tiny_model
    import os
    import statistics

    from asyncrl.rollouter.engines.builtin import kv_cache, model_runner
    from bench_engine import SHORT_MODEL, EngineRunner, short_workload, workload

    short = args.workload == "short"
    if short:
        prompts, lengths = short_workload(args.prompts // 8, 8, args.seed)
        slots, model_shape = len(prompts), SHORT_MODEL
    else:
        prompts, lengths = workload(args.prompts, args.median, args.seed)
        # bench_engine's long-tail model: 2 query heads of 32 over one key/value head.
        slots, model_shape = args.slots, dict(initializer_range=0.2, num_attention_heads=2, num_key_value_heads=1)
    totals: dict[str, float] = defaultdict(float)
    # Instrument the module-level functions and the cache's methods the runner calls.
    model_runner.step_masks = timed(totals, "masks + block tables", kv_cache.step_masks)
    model_runner.sample_tokens = timed(totals, "sampling", model_runner.sample_tokens)
    kv_cache.PagedKVCache.update = timed(totals, "kv write + read", kv_cache.PagedKVCache.update)
    kv_cache.PagedKVCache.begin = timed(totals, "masks + block tables", kv_cache.PagedKVCache.begin)

    forward_rows = model_runner.ModelRunner._forward_rows
    nested = ("masks + block tables", "kv write + read")

    def forward_rows_timed(self, rows, pending, lo, hi, starts):
        # The model forward alone: the mask and cache timers inside it are taken out.
        key = "forward (with prompts)" if any(len(p) > 1 for p in pending[lo:hi]) else "forward (decode only)"
        before = sum(totals[k] for k in nested)
        start = time.perf_counter()
        try:
            return forward_rows(self, rows, pending, lo, hi, starts)
        finally:
            elapsed = time.perf_counter() - start
            totals["rows"] += elapsed
            totals[key] += elapsed - (sum(totals[k] for k in nested) - before)
            totals[key + " n"] += 1

    model_runner.ModelRunner._forward_rows = forward_rows_timed
    model_runner.ModelRunner.forward = timed(totals, "runner.forward", model_runner.ModelRunner.forward)
    model_runner.ModelRunner.plan = timed(totals, "plan (blocks)", model_runner.ModelRunner.plan)
    runs_of_steps = hasattr(model_runner.ModelRunner, "run_steps")
    if runs_of_steps:
        run_steps = timed(totals, "run_steps", model_runner.ModelRunner.run_steps)

        def counted(self, *args):
            totals["hops"] += 1
            return run_steps(self, *args)

        model_runner.ModelRunner.run_steps = counted

    keys = ("forward (with prompts)", "forward (decode only)", *nested, "sampling", "plan (blocks)",
            "step bookkeeping", "event loop + thread hops")

    def parts_of(seconds, steps):
        parts = {k: totals[k] for k in keys[:-2]}
        rest = totals["runner.forward"] - totals["rows"] - totals["sampling"]  # followers' logits
        if runs_of_steps:
            parts["step bookkeeping"] = rest + totals["run_steps"] - totals["plan (blocks)"] - totals["runner.forward"]
        else:  # one hop per step; the bookkeeping ran on the loop
            parts["step bookkeeping"] = rest
            totals["hops"] = steps
        parts["event loop + thread hops"] = seconds - sum(parts.values())
        return parts

    async def run(path):
        runner = EngineRunner(path, slots, seeded=short)
        out = []
        try:
            await runner.run(prompts, lengths)
            for rep in range(args.repeats):
                totals.clear()
                load, cpu = os.getloadavg()[0], time.process_time()
                _, seconds = await runner.run(prompts, lengths)
                cpu = time.process_time() - cpu
                parts = parts_of(seconds, runner.steps)
                out.append((seconds, runner.steps, parts, cpu, dict(totals)))
                print(f"  run {rep + 1}/{args.repeats}: {seconds:.3f} s, {runner.steps} steps, "
                      f"{seconds / runner.steps * 1e3:.2f} ms/step (cpu {cpu / runner.steps * 1e3:.2f}), "
                      f"{int(totals['hops'])} thread hops, load {load:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
            return out
        finally:
            await runner.engine.close()

    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        positions = max(256, max(len(p) for p in prompts) + max(lengths))
        path = build_tiny_model(tmp, max_position_embeddings=positions, **model_shape)
        runs = asyncio.run(run(path))
    load1 = os.getloadavg()

    med = statistics.median
    steps = runs[0][1]
    seconds = med(r[0] for r in runs)
    last = runs[-1][4]
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load (1/5/15 min) "
        f"{load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f} -> {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}\n"
        f"{sum(lengths)} tokens, median of {len(runs)} runs {seconds:.3f} s ({sum(lengths) / seconds:.0f} tok/s), "
        f"{steps} steps, {seconds / steps * 1e3:.2f} ms/step (cpu {med(r[3] for r in runs) / steps * 1e3:.2f}); "
        f"forwards: {int(last['forward (with prompts) n'])} with prompts, {int(last['forward (decode only) n'])} "
        f"decode only; thread hops {med(int(r[4]['hops']) for r in runs)}"
    )
    for key in keys:
        value = med(r[2][key] for r in runs)
        share = med(r[2][key] / r[0] for r in runs)
        print(f"  {key:26s} {value:6.3f} s  {100 * share:5.1f} %  {value / steps * 1e3:6.3f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
