"""Where the built-in engine's time goes on the `bench_engine` workload.

Runs the engine once (after a warm-up run) with wall-clock timers wrapped around the parts
of a step and prints each part's share of the run:

- ``forward (with prompts)`` / ``forward (decode only)``: the model forwards of steps that
  prefill admitted requests and of pure decode steps, excluding the pieces below;
- ``kv write + read views``: `SlotKVCache.update` (the per-layer ``index_put_`` and views);
- ``masks + positions``: `step_masks` and the step's input tensors (`SlotKVCache.begin`);
- ``sampling``: `sample_tokens` (log-softmax, greedy argmax, behaviour log-probs);
- ``row bookkeeping``: `ModelRunner.plan` (rows of finished requests refilled);
- ``scheduler + event loop``: the rest of the wall time (admission, appending tokens,
  finishing requests, the worker-thread hop per step, asyncio).

The timers add a few microseconds per call; the shares, not the absolute times, are the point.

    PYTHONPATH=. python scripts/profile_engine.py [--median 12] [--slots 16]
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
    from asyncrl.rollouter import kv_batch, model_runner
    from bench_engine import EngineRunner, workload

    prompts, lengths = workload(args.prompts, args.median, args.seed)
    totals: dict[str, float] = defaultdict(float)
    # Instrument the module-level functions and the cache's methods the runner calls.
    model_runner.step_masks = timed(totals, "masks + positions", kv_batch.step_masks)
    model_runner.sample_tokens = timed(totals, "sampling", model_runner.sample_tokens)
    kv_batch.SlotKVCache.update = timed(totals, "kv write + read views", kv_batch.SlotKVCache.update)
    kv_batch.SlotKVCache.begin = timed(totals, "masks + positions", kv_batch.SlotKVCache.begin)

    forward_rows = model_runner.ModelRunner._forward_rows
    nested = ("masks + positions", "kv write + read views")

    def forward_rows_timed(self, rows, pending, lo, hi):
        # The model forward alone: the mask and cache timers inside it are taken out.
        key = "forward (with prompts)" if any(len(p) > 1 for p in pending[lo:hi]) else "forward (decode only)"
        before = sum(totals[k] for k in nested)
        start = time.perf_counter()
        try:
            return forward_rows(self, rows, pending, lo, hi)
        finally:
            totals[key] += time.perf_counter() - start - (sum(totals[k] for k in nested) - before)
            totals[key + " n"] += 1

    model_runner.ModelRunner._forward_rows = forward_rows_timed
    model_runner.ModelRunner.plan = timed(totals, "row bookkeeping", model_runner.ModelRunner.plan)

    async def run(path):
        runner = EngineRunner(path, args.slots)
        try:
            await runner.run(prompts, lengths)
            totals.clear()
            _, seconds = await runner.run(prompts, lengths)
            return seconds, runner.steps
        finally:
            await runner.engine.close()

    with tempfile.TemporaryDirectory() as tmp:
        positions = max(256, max(len(p) for p in prompts) + max(lengths))
        path = build_tiny_model(tmp, initializer_range=0.2, max_position_embeddings=positions)
        seconds, steps = asyncio.run(run(path))

    keys = ("forward (with prompts)", "forward (decode only)", *nested, "sampling", "row bookkeeping")
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
