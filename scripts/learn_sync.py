"""On-policy synchronous GRPO on the built-in addition task: print the learning curve.

Each step generates ``--n`` responses for each of ``--prompts`` prompts with the built-in
TorchEngine (temperature 1), rewards them, trains one step on FSDP2 ranks (Ray actors, gloo on
CPU), and loads the new weights into the engine (pause keep -> load -> resume). The starting
policy is the warm-started tiny model (`asyncrl.models.default_model_path`).

    python scripts/learn_sync.py                  # the full curve (a few minutes on 2 CPU cores)
    python scripts/learn_sync.py --steps 10       # shorter

Prints one line per step and, at the end, the mean reward of the first and last ``--window``
steps and of greedy decoding on held-out prompts before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="generate-then-train steps")
    p.add_argument("--prompts", type=int, default=32, help="prompts (groups) per step")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--world-size", type=int, default=1, help="trainer ranks (Ray actors)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=5, help="steps averaged for the first/last summary")
    p.add_argument("--model", default=None, help="HF model dir (default: the warm-started tiny model)")
    p.add_argument("--jsonl", default=None, help="also write each step's metrics to this file")
    return p.parse_args()


async def evaluate_greedy(engine, tokenizer, rows) -> float:
    """Mean reward of greedy answers to ``rows`` (held-out prompts)."""
    from asyncrl.tasks import arithmetic
    from asyncrl.types import GenerateRequest, SamplingParams

    async def one(i, row):
        req = GenerateRequest(request_id=f"eval{i}", prompt_ids=arithmetic.encode_prompt(tokenizer, row["prompt"]),
                              max_tokens=8, sampling=SamplingParams(greedy=True))
        res = await engine.generate(req)
        return arithmetic.reward(row["prompt"], arithmetic.decode_response(tokenizer, res.response_ids))

    scores = await asyncio.gather(*[one(i, r) for i, r in enumerate(rows)])
    return sum(scores) / len(scores)


async def main(args: argparse.Namespace) -> list[dict]:
    import ray
    import torch

    from asyncrl.models import default_model_path
    from asyncrl.models.tiny import build_tokenizer
    from asyncrl.rollouter.torch_engine import TorchEngine
    from asyncrl.tasks import arithmetic
    from asyncrl.trainer.config import AlgorithmConfig, OptimConfig, TrainerConfig, WorkerConfig
    from asyncrl.trainer.ranks import RankGroup
    from asyncrl.trainer.sync_loop import SyncGRPOConfig, learn_sync

    torch.set_num_threads(1)
    model = args.model or str(default_model_path())
    tok = build_tokenizer()
    cfg = SyncGRPOConfig(
        trainer=TrainerConfig(
            worker=WorkerConfig(model_path=model, micro_batch_size=32, pad_token_id=tok.pad_token_id, seed=args.seed,
                                algorithm=AlgorithmConfig(loss_agg_mode="token-mean"),
                                optim=OptimConfig(lr=args.lr, warmup_steps=2)),
            world_size=args.world_size, groups_per_batch=args.prompts),
        steps=args.steps, n=args.n, seed=args.seed,
    )
    ray.init(num_cpus=max(2, args.world_size), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    ranks = RankGroup.start_ray(cfg.trainer)
    engine = TorchEngine(model, max_running=args.prompts * args.n, seed=args.seed)
    held_out = arithmetic.generate_dataset(200, seed=10_000 + args.seed)
    out = open(args.jsonl, "w") if args.jsonl else None
    try:
        before = await evaluate_greedy(engine, tok, held_out)
        print(f"model {model}\ngreedy reward on 200 held-out prompts before: {before:.3f}")
        print(f"{'step':>4} {'reward':>7} {'loss':>8} {'clip':>6} {'entropy':>7} {'grad':>6} {'len':>5} "
              f"{'gen_s':>6} {'train_s':>7}")

        def show(m: dict) -> None:
            print(f"{int(m['step']):>4} {m['reward_mean']:>7.3f} {m['loss']:>8.4f} {m['clip_frac']:>6.3f} "
                  f"{m['entropy']:>7.3f} {m['grad_norm']:>6.3f} {m['response_length_mean']:>5.2f} "
                  f"{m['generate_s']:>6.2f} {m['train_sync_s']:>7.2f}", flush=True)
            if out:
                out.write(json.dumps(m) + "\n")

        t0 = time.perf_counter()
        history = await learn_sync(cfg, ranks, engine, tok, on_step=show)
        wall = time.perf_counter() - t0
        after = await evaluate_greedy(engine, tok, held_out)
    finally:
        await engine.close()
        ranks.close()
        ray.shutdown()
        if out:
            out.close()
    w = min(args.window, len(history))
    first = sum(m["reward_mean"] for m in history[:w]) / w
    last = sum(m["reward_mean"] for m in history[-w:]) / w
    print(f"sampled reward (T=1): first {w} steps {first:.3f} -> last {w} steps {last:.3f} "
          f"({last - first:+.3f}) in {wall:.0f} s")
    print(f"greedy reward on held-out prompts: {before:.3f} -> {after:.3f}")
    return history


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
