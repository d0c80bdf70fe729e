"""Where the built-in engine's time goes on a `bench_engine` workload.

Runs the engine once (after a warm-up run) with wall-clock timers wrapped around the parts
of a step and prints each part's share of the run:

- ``forward (with prompts)`` / ``forward (decode only)``: the model forwards of steps that
  prefill admitted requests and of pure decode steps, excluding the pieces below;
- ``kv write + read``: `PagedKVCache.update` (per layer: the new keys/values into their
  slots, the rows' cache gathered through their block tables);
- ``masks + block tables``: `step_masks` and the forward's slot indices (`PagedKVCache.begin`,
  block copies and pool growth included);
- ``sampling``: `sample_tokens` (log-softmax, greedy argmax or seeded draws, log-probs);
- ``block bookkeeping``: `ModelRunner.plan` (blocks of finished requests freed, new ones
  allocated, shared prompts forked);
- ``scheduler + event loop``: the rest of the wall time (admission, appending tokens,
  finishing requests, the worker-thread hop per step, asyncio).

``--workload short`` profiles bench_engine's short-response workload (a 4-layer Qwen2, 8
prompts x n=8, 64 slots, seeded temperature-1 sampling as in an RL run) instead of the
long-tail one (the 2-layer tiny model, greedy).

The timers add a few microseconds per call; the shares, not the absolute times, are the point.

    PYTHONPATH=. python scripts/profile_engine.py [--workload short] [--median 12] [--slots 16]
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
    from asyncrl.rollouter.engines.builtin import kv_cache, model_runner
    from bench_engine import SHORT_MODEL, EngineRunner, short_workload, workload

    short = args.workload == "short"
    if short:
        prompts, lengths = short_workload(args.prompts // 8, 8, args.seed)
        slots, model_shape = len(prompts), SHORT_MODEL
    else:
        prompts, lengths = workload(args.prompts, args.median, args.seed)
        slots, model_shape = args.slots, dict(initializer_range=0.2)
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
            totals[key] += time.perf_counter() - start - (sum(totals[k] for k in nested) - before)
            totals[key + " n"] += 1

    model_runner.ModelRunner._forward_rows = forward_rows_timed
    model_runner.ModelRunner.plan = timed(totals, "block bookkeeping", model_runner.ModelRunner.plan)

    async def run(path):
        runner = EngineRunner(path, slots, seeded=short)
        try:
            await runner.run(prompts, lengths)
            totals.clear()
            _, seconds = await runner.run(prompts, lengths)
            return seconds, runner.steps
        finally:
            await runner.engine.close()

    with tempfile.TemporaryDirectory() as tmp:
        positions = max(256, max(len(p) for p in prompts) + max(lengths))
        path = build_tiny_model(tmp, max_position_embeddings=positions, **model_shape)
        seconds, steps = asyncio.run(run(path))

    keys = ("forward (with prompts)", "forward (decode only)", *nested, "sampling", "block bookkeeping")
    parts = {k: totals[k] for k in keys}
    parts["scheduler + event loop"] = seconds - sum(parts.values())
    print(
        f"{sum(lengths)} tokens in {seconds:.2f} s ({sum(lengths) / seconds:.0f} tok/s), {steps} steps, "
        f"{seconds / steps * 1e3:.2f} ms/step; forwards: {int(totals['forward (with prompts) n'])} with prompts, "
        f"{int(totals['forward (decode only) n'])} decode only"
    )
    for key, value in parts.items():
        print(f"  {key:26s} {value:6.3f} s  {100 * value / seconds:5.1f} %  {value / steps * 1e3:6.3f} ms/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
