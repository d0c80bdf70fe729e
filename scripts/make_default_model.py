"""Rebuild the shipped default model, ``asyncrl/models/tiny_arith/``, with the warm-start recipe.

Builds the tiny model from its config and seed, runs the noisy supervised phase of
`asyncrl.demos.warm_start` (about 1-2 minutes on one CPU core), measures its greedy and
sampled rewards on held-out problems, and writes the weights, the tokenizer files and
``warm_start.json`` (settings, rewards, the weights' sha256, the torch build) into ``--out``.
It refuses to replace the shipped model with one whose rewards lie outside the band the demo
needs (`warm_start.DEMO_GREEDY_BAND`, `DEMO_SAMPLED_BAND`), unless ``--force``.

    python scripts/make_default_model.py                      # rebuild the shipped model in place
    python scripts/make_default_model.py --out /tmp/m --noise 0.6 --steps 800   # try a variant

Float rounding differs between CPUs and torch builds, so a rebuild elsewhere may give other
weights and other rewards: that is why the result is shipped rather than built at first use.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from asyncrl.models import DEFAULT_MODEL_DIR
from asyncrl.demos.warm_start import WarmStartConfig, check_demo_band, warm_start
from asyncrl.tasks.arithmetic import ArithmeticTaskConfig

SHIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "warm_start.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = WarmStartConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR, help="model directory to (re)write")
    p.add_argument("--steps", type=int, default=d.steps, help="supervised optimizer steps")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--noise", type=float, default=d.noise, help="fraction of near-miss target answers")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--force", action="store_true", help="write the model even if its rewards are out of band")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(1)  # the recipe as shipped ran on one thread
    config = WarmStartConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, noise=args.noise,
                             seed=args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".make-default-model-", dir=args.out.parent) as tmp:
        info = warm_start(tmp, config=config, task=ArithmeticTaskConfig())
        print(json.dumps({k: info[k] for k in ("settings", "train_seconds", "greedy_reward", "sampled_reward_t1")}))
        problems = check_demo_band(info)
        if problems and not args.force:
            print(f"not written to {args.out}: {'; '.join(problems)} (the demo's band); --force writes it anyway",
                  file=sys.stderr)
            return 1
        args.out.mkdir(exist_ok=True)
        for name in SHIPPED_FILES:
            shutil.copyfile(Path(tmp) / name, args.out / name)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
