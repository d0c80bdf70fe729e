"""Rebuild the calculator task's shipped model, ``asyncrl/models/tiny_calc/``, with its warm-start recipe.

Builds the tiny chat model from its config and seed, runs the two supervised phases of
`asyncrl.demos.calculator` (about 5 minutes on one CPU core), measures its reward and tool-call
rate through the agent loop (greedy and sampled at T=1) on held-out problems, and writes the
weights, the tokenizer files and ``warm_start.json`` into ``--out``. It refuses to replace the
shipped model with one whose sampled reward lies outside the demo's band
(`calculator.DEMO_SAMPLED_BAND`), unless ``--force``.

    python scripts/make_calculator_model.py                  # rebuild the shipped model in place
    python scripts/make_calculator_model.py --out /tmp/m --tool-rate 0.3   # try a variant
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from asyncrl.models import CALCULATOR_MODEL_DIR
from asyncrl.demos.calculator import DEMO_SAMPLED_BAND, CalculatorWarmStartConfig, warm_start

SHIPPED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "warm_start.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = CalculatorWarmStartConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=CALCULATOR_MODEL_DIR, help="model directory to (re)write")
    p.add_argument("--copy-steps", type=int, default=d.copy_steps, help="first phase: tool conversations only")
    p.add_argument("--steps", type=int, default=d.steps, help="second phase: the mixture")
    p.add_argument("--tool-rate", type=float, default=d.tool_rate, help="share of the mixture that calls the tool")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--force", action="store_true", help="write the model even if its reward is out of band")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(1)  # the recipe as shipped ran on one thread
    config = CalculatorWarmStartConfig(copy_steps=args.copy_steps, steps=args.steps, tool_rate=args.tool_rate,
                                       lr=args.lr, seed=args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".make-calculator-model-", dir=args.out.parent) as tmp:
        info = warm_start(tmp, config=config)
        print(json.dumps({k: info[k] for k in ("settings", "train_seconds", "greedy", "sampled_t1")}))
        lo, hi = DEMO_SAMPLED_BAND
        sampled = info["sampled_t1"]["reward"]
        if not lo <= sampled <= hi and not args.force:
            print(f"not written to {args.out}: sampled reward {sampled:.3f} is outside [{lo}, {hi}] (the demo's band); "
                  "--force writes it anyway", file=sys.stderr)
            return 1
        args.out.mkdir(exist_ok=True)
        for name in SHIPPED_FILES:
            if (Path(tmp) / name).is_file():
                shutil.copyfile(Path(tmp) / name, args.out / name)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
