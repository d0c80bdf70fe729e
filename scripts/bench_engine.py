"""Benchmark: the built-in continuous-batching engine vs static-batch ``model.generate``.

Both sides get the same prompts, the same response lengths and the same number of sequence
slots (``--slots``): the engine decodes at most ``slots`` requests at once and admits a new
one whenever one finishes; the baseline runs transformers' ``generate`` on consecutive
batches of ``slots`` prompts (left-padded), each batch running until its longest response is
done. Greedy decoding, EOS disabled, so every response has exactly its assigned length.

Response lengths (long tail): with median ``m`` (``--median``, default 12), 7 of 8 requests
draw a length uniformly from [m/2, 3m/2], 1 of 8 uniformly from [4m, 16m], and one request is
exactly 16m. Throughput = assigned response tokens / wall seconds.

A second engine run pauses with ``keep`` mid-generation, reloads the weights in place and
resumes; it reports the tokens re-prefilled (target 0) and checks its tokens equal the run
without a pause.

    python scripts/bench_engine.py            # human-readable
    python scripts/bench_engine.py --json     # last line: {"engine_tok_s", "static_tok_s", "speedup", ...}
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=64, help="number of requests")
    p.add_argument("--slots", type=int, default=16, help="engine max_running = baseline batch size")
    p.add_argument("--median", type=int, default=12, help="median response length")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    return p.parse_args(argv)


def workload(n, median, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 40, size=int(rng.integers(4, 17))) for _ in range(n)]
    lengths = [
        int(rng.integers(4 * median, 16 * median + 1)) if rng.random() < 1 / 8 else int(rng.integers(median // 2, 3 * median // 2 + 1))
        for _ in range(n)
    ]
    lengths[int(rng.integers(n))] = 16 * median
    return prompts, lengths


async def run_engine(model_path, prompts, lengths, slots, pause_keep=False):
    import asyncio

    from asyncrl.rollouter.torch_engine import TorchEngine
    from asyncrl.types import GenerateRequest, SamplingParams

    engine = TorchEngine(model_path, max_running=slots, eos_token_ids=())
    greedy = SamplingParams(greedy=True)
    try:
        await engine.generate(GenerateRequest("warmup", prompts[0], max_tokens=4, sampling=greedy))
        reqs = [GenerateRequest(f"r{i}", p, max_tokens=n, sampling=greedy) for i, (p, n) in enumerate(zip(prompts, lengths))]
        start = time.perf_counter()
        tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
        if pause_keep:
            await asyncio.sleep(0)
            longest = max(range(len(reqs)), key=lambda i: lengths[i])
            await engine.wait_for_tokens(f"r{longest}", lengths[longest] // 2, timeout_s=600)
            await engine.pause("keep")
            await engine.load_weights([(n, p.detach().clone()) for n, p in engine.model.named_parameters()])
            await engine.finish_weight_update(1)
            await engine.resume()
        results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
        return results, seconds, engine.stats()
    finally:
        await engine.close()


def run_static(model_path, prompts, lengths, slots):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    pad = model.config.pad_token_id

    def batch_generate(batch_prompts, max_new):
        width = max(len(p) for p in batch_prompts)
        ids = torch.full((len(batch_prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch_prompts):  # left padding, as generate expects for decoder-only models
            ids[i, width - len(p) :] = torch.as_tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.no_grad():
            return model.generate(
                ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=pad
            )

    batch_generate(prompts[:1], 4)  # warm-up
    start = time.perf_counter()
    outs = []
    for b in range(0, len(prompts), slots):
        out = batch_generate(prompts[b : b + slots], max(lengths[b : b + slots]))
        outs.extend(out[:, out.shape[1] - max(lengths[b : b + slots]) :])
    return outs, time.perf_counter() - start


def main(argv=None) -> int:
    args = parse_args(argv)
    import asyncio

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from asyncrl.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_path = build_tiny_model(tmp, initializer_range=0.2)
        prompts, lengths = workload(args.prompts, args.median, args.seed)
        total = sum(lengths)
        results, engine_s, stats = asyncio.run(run_engine(model_path, prompts, lengths, args.slots))
        static_outs, static_s = run_static(model_path, prompts, lengths, args.slots)
        kept, _, kept_stats = asyncio.run(run_engine(model_path, prompts, lengths, args.slots, pause_keep=True))

    assert [len(r.response_ids) for r in results] == lengths
    same_as_static = all(
        np.array_equal(r.response_ids, o[:n].numpy()) for r, o, n in zip(results, static_outs, lengths)
    )
    same_after_keep = all(np.array_equal(a.response_ids, b.response_ids) for a, b in zip(results, kept))
    report = {
        "engine_tok_s": round(total / engine_s, 1),
        "static_tok_s": round(total / static_s, 1),
        "speedup": round(static_s / engine_s, 2),
        "reprefill_tokens_keep": kept_stats["reprefill_tokens"],
        "tokens": total,
        "prompts": args.prompts,
        "slots": args.slots,
        "median_len": int(np.median(lengths)),
        "max_len": max(lengths),
        "engine_steps": stats["steps"],
        "static_steps": sum(max(lengths[b : b + args.slots]) for b in range(0, len(lengths), args.slots)),
        "tokens_equal_static": same_as_static,
        "tokens_equal_after_keep": same_after_keep,
    }
    print(
        f"{args.prompts} prompts, {total} response tokens (median {report['median_len']}, max {report['max_len']}), "
        f"{args.slots} slots, {args.threads} thread(s)\n"
        f"  engine (continuous batching): {engine_s:6.2f} s  {report['engine_tok_s']:8.1f} tok/s  "
        f"{report['engine_steps']} steps\n"
        f"  static-batch HF generate:     {static_s:6.2f} s  {report['static_tok_s']:8.1f} tok/s  "
        f"{report['static_steps']} decode steps\n"
        f"  speedup {report['speedup']}x; greedy tokens equal: {same_as_static}; "
        f"pause(keep)+reload: reprefill_tokens={report['reprefill_tokens_keep']}, tokens equal: {same_after_keep}",
        file=sys.stderr if args.json else sys.stdout,
    )
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
