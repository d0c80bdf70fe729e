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


SAVED_ARGS = "launch.json"
"""The run's flags, saved in its run directory so ``--resume`` continues it with the same ones."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    if args.resume is not None:
        args = _resumed(args, vars(_parser(argparse.SUPPRESS).parse_args(argv)))
    _check(args)
    return args


def _parser(default=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m asyncrl.launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, argument_default=default)
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
    out.add_argument("--resume", default=None, metavar="RUN_DIR",
                     help="continue the run in RUN_DIR from its latest checkpoint, with its saved flags "
                          "(flags given here win, e.g. --steps to train further)")
    if default is argparse.SUPPRESS:  # a parser that returns only the flags given
        for action in p._actions:
            action.default = argparse.SUPPRESS
    return p


def _resumed(args: argparse.Namespace, given: dict) -> argparse.Namespace:
    """The saved flags of the run being resumed, with the ones given now on top."""
    import json
    from pathlib import Path

    run_dir = Path(args.resume)
    saved_path = run_dir / SAVED_ARGS
    if not saved_path.exists():
        raise SystemExit(_usage(f"--resume {args.resume}: no {SAVED_ARGS} there (not a run directory?)"))
    saved = json.loads(saved_path.read_text())
    merged = {**vars(args), **saved, **given, "run_dir": str(run_dir), "resume": args.resume}
    return argparse.Namespace(**merged)


def _check(args: argparse.Namespace) -> None:
    def error(text: str):
        raise SystemExit(_usage(text))

    p = argparse.Namespace(error=error)
    for name in ("steps", "n", "groups_per_step", "sync_every", "engines", "trainer_ranks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.rollouter_gpus < 0 or args.trainer_gpus < 0:
        p.error("--rollouter-gpus and --trainer-gpus must be >= 0")
    if (args.rollouter_gpus > 0) != (args.trainer_gpus > 0):
        p.error("give both --rollouter-gpus and --trainer-gpus (GPU run) or neither (CPU run)")
    if args.staleness_threshold < 0:
        p.error("--staleness-threshold must be >= 0")


def _usage(text: str) -> int:
    print(f"usage: python -m asyncrl.launch [options]\npython -m asyncrl.launch: error: {text}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import json
    from pathlib import Path

    if args.run_dir is not None and args.resume is None and (Path(args.run_dir) / "checkpoints" / "latest").exists():
        return _usage(f"--run-dir {args.run_dir} holds a checkpoint already: pass --resume {args.run_dir} to "
                      "continue that run, or choose another --run-dir")
    if args.resume is None:
        import time

        args.run_dir = args.run_dir or str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        Path(args.run_dir).mkdir(parents=True, exist_ok=True)
        saved = {k: v for k, v in vars(args).items() if k not in ("resume", "run_dir")}
        (Path(args.run_dir) / SAVED_ARGS).write_text(json.dumps(saved, indent=1) + "\n")
    from asyncrl.pipeline import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
