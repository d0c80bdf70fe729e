"""docs/bench_agent.png from the run directories `bench_agent.py --runs-dir DIR` kept.

    python scripts/bench_agent.py --json --runs-dir runs/bench_agent
    python scripts/plot_bench_agent.py --from runs/bench_agent                 # seed 0 -> docs/bench_agent.png
    python scripts/plot_bench_agent.py --from runs/bench_agent --seed 1 -o bench_seed1.png

Draws one seed's sync, sync + partial and async runs (``{mode}-seed{seed}``) with `asyncrl.plot`:
reward against wall time and against step, and the Trainer's idle share.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("sync", "sync_partial", "async", "async_partial")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="runs_dir", type=Path, required=True, help="bench_agent.py's --runs-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--out", type=Path, default=ROOT / "docs" / "bench_agent.png")
    p.add_argument("--smooth", type=int, default=5)
    args = p.parse_args(argv)
    from asyncrl.plot import draw, read_runs

    found = [args.runs_dir / f"{m}-seed{args.seed}" for m in MODES if (args.runs_dir / f"{m}-seed{args.seed}").is_dir()]
    if not found:
        print(f"plot_bench_agent: no {{mode}}-seed{args.seed} run directories in {args.runs_dir} (run "
              f"scripts/bench_agent.py --runs-dir {args.runs_dir} first)", file=sys.stderr)
        return 2
    draw(read_runs(found), args.out, smooth=args.smooth,
         title=f"calculator task, tool latency log-normal (median 0.2 s, p99 2 s), seed {args.seed}")
    print(f"plot_bench_agent: {', '.join(d.name for d in found)} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
