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
    algo.add_argument("--mode", choices=("async", "sync"), default="async",
                      help="async: fully asynchronous; sync: generate a batch, train, sync, in lockstep "
                           "(on-policy; ignores --staleness-threshold)")
    algo.add_argument("--steps", type=int, default=100, help="train steps to run")
    algo.add_argument("--n", type=int, default=8, help="responses per prompt (group size)")
    algo.add_argument("--groups-per-step", type=int, default=8, help="groups per train step")
    algo.add_argument("--sync-every", type=int, default=1, help="train steps per weight sync (trigger_parameter_sync_step)")
    algo.add_argument("--staleness-threshold", type=float, default=0.5,
                      help="extra fraction of a sync's groups the Rollouter may generate ahead")
    algo.add_argument("--max-tokens", type=int, default=None, help="response budget (default: the task's)")
    algo.add_argument("--lr", type=float, default=None, help="learning rate (default: tuned for the demo)")
    algo.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    part = p.add_argument_group("partial rollout (async mode)")
    part.add_argument("--partial-rollout", action="store_true",
                      help="truncate each round's long tail across all engines; truncated responses resume next round")
    part.add_argument("--partial-threshold", type=int, default=None,
                      help="finished trajectories that end a round (default: groups per sync x n)")
    part.add_argument("--partial-max-age", type=int, default=4, help="truncations a response may survive")
    part.add_argument("--long-tail", type=int, default=1, metavar="FACTOR",
                      help="built-in task only: per-prompt response budgets up to FACTOR x the median "
                           "(a power of 2; engines then ignore EOS so responses really are that long)")
    out = p.add_argument_group("output")
    out.add_argument("--run-dir", default=None, help="where metrics and checkpoints go (default: runs/<time>)")
    out.add_argument("--seed", type=int, default=0)
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
    if args.mode == "sync" and args.partial_rollout:
        p.error("--partial-rollout needs --mode async (sync mode generates every batch to the end)")
    if args.mode == "sync" and args.sync_every != 1:
        p.error("--mode sync syncs after every step: --sync-every must be 1")
    if args.long_tail < 1 or args.long_tail & (args.long_tail - 1) or (args.long_tail > 1 and args.dataset):
        p.error("--long-tail must be a power of 2 (1 = off) and is for the built-in task (no --dataset)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from asyncrl.pipeline import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
