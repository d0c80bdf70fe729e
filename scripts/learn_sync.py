"""Learning curve of the built-in addition task: ``python -m asyncrl.launch`` in a mode, summarised.

Runs the launcher (engine actors, Rollouter, ZeroMQ stream, FSDP2 trainer ranks, weight sync)
with the warm-started tiny model, then prints the mean sampled reward of the first and last
``--window`` steps from the run's ``metrics.jsonl``. ``--mode sync`` (the default here) is the
on-policy lockstep baseline: generate a batch, train, sync.

    python scripts/learn_sync.py                       # 60 on-policy steps (a few minutes on 2 CPU cores)
    python scripts/learn_sync.py --mode async --steps 30
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("sync", "async"), default="sync")
    p.add_argument("--steps", type=int, default=60, help="train steps")
    p.add_argument("--prompts", type=int, default=32, help="prompts (groups) per step")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (the demo's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=5, help="steps averaged for the first/last summary")
    p.add_argument("--model", default=None, help="HF model dir (default: the warm-started tiny model)")
    p.add_argument("--run-dir", default=None, help="run directory (default: a temporary one)")
    return p.parse_args()


def learn(mode: str, steps: int, prompts: int, n: int, lr: float, seed: int, run_dir: Path,
          model: str | None = None, extra: list[str] = ()) -> list[dict]:
    """Run the launcher; return each step's metrics. Raises with the output's tail on failure."""
    cmd = [sys.executable, "-m", "asyncrl.launch", "--mode", mode, "--steps", str(steps), "--groups-per-step",
           str(prompts), "--n", str(n), "--lr", str(lr), "--seed", str(seed), "--run-dir", str(run_dir), *extra]
    if model:
        cmd += ["--model", model]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{(out.stdout + out.stderr)[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def window_means(history: list[dict], window: int) -> tuple[float, float]:
    w = min(window, len(history))
    first = sum(m["reward_mean"] for m in history[:w]) / w
    last = sum(m["reward_mean"] for m in history[-w:]) / w
    return first, last


def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.run_dir or Path(tmp) / "run")
        t0 = time.perf_counter()
        history = learn(args.mode, args.steps, args.prompts, args.n, args.lr, args.seed, run_dir, args.model)
        wall = time.perf_counter() - t0
    for m in history:
        print(f"{int(m['step']):>4} reward {m['reward_mean']:.3f} loss {m['loss']:+.4f} "
              f"staleness {m['staleness_mean']:.2f} len {m['response_length_mean']:.2f}")
    first, last = window_means(history, args.window)
    print(f"{args.mode}: sampled reward (T=1) first {args.window} steps {first:.3f} -> last {args.window} steps "
          f"{last:.3f} ({last - first:+.3f}) in {wall:.0f} s")


if __name__ == "__main__":
    main(parse_args())
