"""``python -m asyncrl.launch``: parse flags, start or join Ray, place the processes, run, shut down.

With no flags on a machine without GPUs it runs the CPU demo: the tiny warm-started model
learns the built-in addition task, fully asynchronously, in a few minutes::

    python -m asyncrl.launch

On a GPU cluster (Ray already running, or under ``ray job submit``)::

    python -m asyncrl.launch --rollouter-gpus 8 --trainer-gpus 8 \\
        --model /models/Qwen2.5-1.5B --dataset data/train.jsonl --reward mypkg.rewards:score

Heavy packages (torch, ray, transformers) are imported only after the flags are parsed, so
``--help`` is instant.
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m asyncrl.launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    place = p.add_argument_group("placement")
    place.add_argument("--rollouter-gpus", type=int, default=0,
                       help="GPUs for inference engines (one vLLM engine per GPU); 0 = built-in engine on CPU")
    place.add_argument("--trainer-gpus", type=int, default=0, help="GPUs for FSDP2 trainer ranks; 0 = CPU ranks")
    place.add_argument("--engines", type=int, default=1, help="built-in engines when --rollouter-gpus is 0")
    place.add_argument("--trainer-ranks", type=int, default=1, help="trainer ranks when --trainer-gpus is 0")
    place.add_argument("--address", default=None, help="Ray address to join (default: RAY_ADDRESS, else a local Ray)")
    data = p.add_argument_group("model and data")
    data.add_argument("--model", default=None, help="local HF model directory (default: the tiny warm-started model)")
    data.add_argument("--dataset", default=None, help="JSONL with a 'prompt' column (default: the built-in task)")
    data.add_argument("--reward", default=None,
                      help="reward as module:function(prompt_text, response_text) -> float (default: built-in task)")
    algo = p.add_argument_group("algorithm")
    algo.add_argument("--steps", type=int, default=100, help="train steps to run")
    algo.add_argument("--n", type=int, default=8, help="responses per prompt (group size)")
    algo.add_argument("--groups-per-step", type=int, default=8, help="groups per train step")
    algo.add_argument("--sync-every", type=int, default=1, help="train steps per weight sync (trigger_parameter_sync_step)")
    algo.add_argument("--staleness-threshold", type=float, default=0.5,
                      help="extra fraction of a sync's groups the Rollouter may generate ahead")
    algo.add_argument("--max-tokens", type=int, default=None, help="response budget (default: the task's)")
    algo.add_argument("--lr", type=float, default=None, help="learning rate (default: tuned for the demo)")
    algo.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    out = p.add_argument_group("output")
    out.add_argument("--run-dir", default=None, help="where metrics and checkpoints go (default: runs/<time>)")
    out.add_argument("--seed", type=int, default=0)
    # metrics (asyncrl.metrics, README "Metrics")
    out.add_argument("--dashboard", action="store_true", help="serve the live dashboard on 127.0.0.1 (port 8050)")
    out.add_argument("--metrics-sinks", default="jsonl,console",
                     help="comma-separated: jsonl (always on), console, tensorboard, prometheus, wandb")
    out.add_argument("--no-metrics", action="store_true", help="no metric stream (only a plain progress line)")
    args = p.parse_args(argv)
    for name in ("steps", "n", "groups_per_step", "sync_every", "engines", "trainer_ranks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.rollouter_gpus < 0 or args.trainer_gpus < 0:
        p.error("--rollouter-gpus and --trainer-gpus must be >= 0")
    if (args.rollouter_gpus > 0) != (args.trainer_gpus > 0):
        p.error("give both --rollouter-gpus and --trainer-gpus (GPU run) or neither (CPU run)")
    if args.staleness_threshold < 0:
        p.error("--staleness-threshold must be >= 0")
    from asyncrl.metrics.config import SINKS

    args.metrics_sinks = tuple(s for s in args.metrics_sinks.split(",") if s)
    if unknown := [s for s in args.metrics_sinks if s not in SINKS]:
        p.error(f"--metrics-sinks: unknown {unknown}; choose from {','.join(SINKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from asyncrl.pipeline import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
