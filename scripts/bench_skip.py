"""Benchmark: producing a listed step's groups from skip dumps vs generating them.

One train step's worth of groups of the CPU demo's model (the warm-started tiny model, the
built-in addition task, ``--groups`` prompts x ``--n`` responses) is produced by the Rollouter in
two ways, alternating, ``--repeats`` times each, on one warm engine. The workload by default is
the long tail that generation costs a user (``--long-tail 16``: per-prompt budgets of 6 tokens
up to 16x that, 96, EOS off, as `scripts/bench_e2e.py` runs); ``--long-tail 1`` is the demo's own
3-token answers, where a step's generation takes tens of milliseconds:

- generate: the ``async_rollout`` role is off; every response is a request to the engine;
- replay: the role is on (``cache``) over dumps written once beforehand; no engine request
  (checked with the engine's request counter).

Each side reports its median wall time from the first prompt fed to the last group sent
(the Rollouter's whole path: feed, skip lookup or generation, reward, send to a list).

    python scripts/bench_skip.py            # human-readable
    python scripts/bench_skip.py --json     # last line: {"generate_s", "replay_s", "replay_vs_generate",
                                            #             "replay_ms_per_group", "generate_ms_per_group", ...}

Target: replay costs <= 5% of generation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=8, help="groups (prompts) in the step")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--long-tail", type=int, default=16,
                   help="per-prompt response budgets up to this many times the median, EOS off (1: the demo's answers)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each side (alternating); medians are reported")
    p.add_argument("--model", default=None, help="HF model dir (default: the CPU demo's warm-started tiny model)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    return p.parse_args(argv)


class ListProducer:
    def __init__(self):
        self.groups = []

    async def send(self, group):
        self.groups.append(group)


async def produce(engine, prompts, cfg, reward, num_groups) -> tuple[float, list]:
    from asyncrl.rollouter.rollouter import Rollouter

    producer = ListProducer()
    rollouter = Rollouter(cfg, [engine], producer, prompts, reward)
    t0 = time.perf_counter()
    await rollouter.run(num_groups=num_groups)
    return time.perf_counter() - t0, producer.groups


async def main(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from asyncrl.models import default_model_path
    from asyncrl.rollouter.rollouter import RolloutConfig
    from asyncrl.rollouter.engines.builtin.engine import TorchEngine
    from asyncrl.rollouter.worker import builtin_task_prompts
    from asyncrl.skip import SkipConfig, SkipManager, SkipRoleConfig, is_replayed, model_fingerprint, rollout_shape
    from asyncrl.tasks import arithmetic

    torch.set_num_threads(args.threads)
    model = str(args.model or default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model)
    task = arithmetic.ArithmeticTaskConfig(long_tail_factor=args.long_tail)
    prompts = builtin_task_prompts(tokenizer, arithmetic.generate_dataset(args.groups, seed=0, config=task))

    def reward(prompt, response_ids):
        return arithmetic.reward(prompt.text, arithmetic.decode_response(tokenizer, response_ids))

    cfg = RolloutConfig(n=args.n, max_tokens=task.max_response_tokens * args.long_tail,
                        groups_per_sync=args.groups, max_concurrent=args.groups, seed=0)
    shape = rollout_shape(cfg, model=model_fingerprint(model), data=f"builtin:arithmetic:{args.groups}:x{args.long_tail}",
                          reward="builtin")
    # the long tail runs every response to its budget, as bench_e2e does (the launcher turns EOS off for it)
    engine = TorchEngine(model, **({"eos_token_ids": ()} if args.long_tail > 1 else {}))
    generate_s, replay_s = [], []
    with tempfile.TemporaryDirectory() as dumps:
        on = SkipConfig(experiment="bench", async_rollout=SkipRoleConfig(enable=True, dump_dir=dumps,
                                                                          steps=list(range(args.groups))))
        try:
            SkipManager.init(on, shape=shape)
            await produce(engine, prompts, cfg, reward, args.groups)  # warm-up, and writes the dumps
            for _ in range(args.repeats):
                SkipManager.init(None)
                dt, groups = await produce(engine, prompts, cfg, reward, args.groups)
                assert not any(map(is_replayed, groups))
                generate_s.append(dt)
                tokens = sum(len(t.response_ids) for g in groups for t in g.trajectories)
                SkipManager.init(on, shape=shape)
                before = engine.stats()["requests"]
                dt, groups = await produce(engine, prompts, cfg, reward, args.groups)
                assert all(map(is_replayed, groups)) and engine.stats()["requests"] == before, "replay reached the engine"
                replay_s.append(dt)
        finally:
            SkipManager.reset()
            await engine.close()
    gen, rep = statistics.median(generate_s), statistics.median(replay_s)
    report = {"generate_s": round(gen, 5), "replay_s": round(rep, 5), "replay_vs_generate": round(rep / gen, 5),
              "replay_ms_per_group": round(rep * 1e3 / args.groups, 3),
              "generate_ms_per_group": round(gen * 1e3 / args.groups, 3),
              "groups": args.groups, "n": args.n, "long_tail": args.long_tail, "response_tokens": tokens,
              "repeats": args.repeats,
              "generate_runs_s": [round(x, 4) for x in generate_s], "replay_runs_s": [round(x, 4) for x in replay_s]}
    print(f"{args.groups} groups x {args.n} responses ({tokens} response tokens, long tail x{args.long_tail}): "
          f"generate {gen * 1e3:.1f} ms, replay from dumps {rep * 1e3:.1f} ms ({rep * 1e3 / args.groups:.2f} ms per "
          f"group) -> replay costs {100 * rep / gen:.2f}% of generation (target <= 5%)",
          file=sys.stderr if args.json else sys.stdout)
    return report


if __name__ == "__main__":
    args = parse_args()
    report = asyncio.run(main(args))
    if args.json:
        print(json.dumps(report))
