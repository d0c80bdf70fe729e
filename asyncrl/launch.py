"""``python -m asyncrl.launch``: parse, config, plan, start, run, close.

With no flags on a machine without GPUs it runs the CPU demo: the tiny warm-started model
learns the built-in addition task, fully asynchronously, in a few minutes::

    python -m asyncrl.launch

On a GPU cluster (Ray already running, or under ``ray job submit``)::

    python -m asyncrl.launch --config run.yaml trainer.optim.lr=1e-6 rollout.n=16
    python -m asyncrl.launch --rollouter-gpus 8 --trainer-gpus 8 \\
        --model /models/Qwen2.5-1.5B --dataset data/train.parquet --reward mypkg.rewards:compute_score

Settings are `asyncrl.config.RunConfig`: a YAML file (``--config``), then dotted overrides
(``key.path=value``); the flags below are short aliases of dotted keys. Everything is checked
before Ray starts (exit 2, one line on stderr). Heavy packages (torch, ray, transformers) are
imported only after the flags are parsed, so ``--help`` is instant.

A run continues from its latest checkpoint with ``--resume RUN_DIR`` (its ``config.yaml``
first, then any ``--config``/flags/overrides given, e.g. ``--steps 200`` to train further);
a run directory that holds a checkpoint is never started over by accident. Ctrl-C or SIGTERM
stops cleanly (checkpoint, drain, exit 0); a second Ctrl-C stops at once (`asyncrl.shutdown`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from asyncrl.config.flags import FLAGS  # imports nothing: --help stays instant

EXIT_USAGE = 2

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line, like every other usage error of the launcher (argparse prints the usage too).
        self.exit(EXIT_USAGE, f"asyncrl: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(prog="python -m asyncrl.launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Any other setting: key.path=value, e.g. trainer.optim.lr=1e-6 "
                                       "skip.async_rollout.steps=[3,4] (--help-config: every key with its default and meaning; "
                                       "--print-config: a run's resolved values).")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="dotted overrides, applied last")
    p.add_argument("--config", action="append", default=[], metavar="run.yaml",
                   help="YAML file of settings (repeatable; later files win, overrides win over files)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--help-config", nargs="?", const="", default=None, metavar="SECTION",
                   help="print every config key (type, default, what it does), or those under SECTION "
                        "(e.g. trainer.optim), and exit; docs/config.md holds the same")
    p.add_argument("--dashboard", action="store_true",
                   help="serve the live metrics dashboard on 127.0.0.1 (metrics.dashboard=true; port metrics.dashboard_port)")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the run in RUN_DIR from its latest checkpoint, with its config.yaml "
                        "(settings given here win)")
    p.add_argument("--dry-run", action="store_true",
                   help="check everything, resolve placement against the cluster, print the plan and the config; "
                        "start nothing heavy")
    for title, flags in FLAGS.items():
        group = p.add_argument_group(title)
        for flag in flags:
            # Values stay text: OmegaConf coerces them and names the key when it cannot.
            group.add_argument("--" + flag.name.replace("_", "-"), dest=flag.name, default=None,
                               metavar=flag.type.__name__.upper(), help=flag.help)
    # Overrides may stand anywhere on the line, between flags too, as in Hydra-style tools
    # (plain parse_args takes only the first run of positionals).
    return p.parse_intermixed_args(argv)


def overrides_of(args: argparse.Namespace) -> list[str]:
    """The flags as dotted overrides (before the explicit ones, which win)."""
    given = [f"{flag.key}={getattr(args, flag.name)}" for flags in FLAGS.values() for flag in flags
             if getattr(args, flag.name) is not None]
    return given + (["metrics.dashboard=true"] if getattr(args, "dashboard", False) else []) + list(args.overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)                                              # parse
    if args.help_config is not None:
        return _help_config(args.help_config)
    from asyncrl.config import ConfigError, load_config, to_yaml
    from asyncrl.data import DataError
    from asyncrl.placement import PlacementError

    try:
        cfg, resolved = load_config(*config_layers(args))                # config
        if args.print_config:
            print(to_yaml(resolved), end="")
            return 0
        preflight(cfg)                                                   # checked before Ray starts
        run_dir = _run_dir(cfg, resume=args.resume is not None)
        if cfg.rollout.agent.endpoint and cfg.rollout.agent.endpoint_forks_path is None:  # forks' first differing messages
            cfg.rollout.agent.endpoint_forks_path = str(run_dir / "endpoint_forks.jsonl")
    except (ConfigError, DataError) as e:
        return _usage_error(e)

    from asyncrl import placement

    cluster = placement.connect(cfg.placement, cpu_actors=cfg.engine_replicas + cfg.trainer_world_size + 1)
    try:
        try:
            plan = placement.make_plan(cfg, cluster)                     # plan
            if args.dry_run:
                print(dry_run(plan))
                print(to_yaml(resolved), end="")
                return 0
        except PlacementError as e:
            return _usage_error(e)
        _make_run_dir(run_dir, resolved)
        return run_restarting(cfg, plan, cluster, run_dir)              # start, run, close (again)
    finally:
        placement.disconnect(cluster)


def run_restarting(cfg, plan, cluster, run_dir: Path) -> int:
    """`run`; when it fails (a process of the run died), start it again from its last checkpoint,
    up to ``cfg.max_restarts`` times, each logged with its cause in ``<run_dir>/restarts.jsonl``.
    The restarted run restores as ``--resume`` does, so every sample is trained once. A
    programming error (`asyncrl.faults`) is not restarted: it would fail the same way again; an
    error of the user's code (`asyncrl.usercode`) exits 1 naming it, the prompt and its traceback."""
    from asyncrl import placement
    from asyncrl.faults import fault_line, programming_error
    from asyncrl.progress import newest_checkpoint
    from asyncrl.usercode import stop_message, user_error

    restarts = 0
    while True:
        try:
            return asyncio.run(run(cfg, plan, run_dir))
        except Exception as e:
            if (user := user_error(e)) is not None:
                print(stop_message(user, run_dir), file=sys.stderr, flush=True)
                return 1
            bug = programming_error(e)
            if bug is not None:
                print(f"asyncrl: not restarting: {bug} is an error in the code, which a restart would meet again; "
                      f"fix it, then continue with: python -m asyncrl.launch --resume {run_dir}",
                      file=sys.stderr, flush=True)
                raise
            if restarts >= cfg.max_restarts:
                # A fault of the run, not of the code: one line naming it (its traceback would
                # point into the launcher, not at the fault), exit 1.
                left = f"no restart left (max_restarts={cfg.max_restarts} used)" if cfg.max_restarts else "max_restarts=0"
                print(f"asyncrl: the run failed ({left}): {fault_line(e)}; once fixed, continue with: "
                      f"python -m asyncrl.launch --resume {run_dir}", file=sys.stderr, flush=True)
                return 1
            restarts += 1
            cause = fault_line(e)[:500]
            with open(run_dir / "restarts.jsonl", "a") as f:
                f.write(json.dumps({"restart": restarts, "time": time.time(), "cause": cause}) + "\n")
            wait = cfg.restart_backoff_s * restarts
            print(f"asyncrl: restart {restarts}/{cfg.max_restarts} of the run from {newest_checkpoint(run_dir)} in "
                  f"{wait:g} s, after {cause}", file=sys.stderr, flush=True)
            time.sleep(wait)
            # Plan again: a node may have gone with the process.
            plan = placement.make_plan(cfg, placement.Cluster(nodes=placement.alive_nodes(),
                                                              started_here=cluster.started_here))


def config_layers(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """YAML files and overrides: a resumed run's own config.yaml first, its run dir kept."""
    from asyncrl.config import ConfigError

    overrides = overrides_of(args)
    if args.resume is None:
        return list(args.config), overrides
    run_dir = Path(args.resume)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume {args.resume}: no config.yaml there (not a run directory)")
    if args.run_dir is not None and Path(args.run_dir).resolve() != run_dir.resolve():
        raise ConfigError(f"--resume {args.resume} continues that run in its own directory; drop --run-dir")
    return [str(run_dir / "config.yaml"), *args.config], [*overrides, f"run_dir={run_dir}"]


def _help_config(section: str) -> int:
    from asyncrl.configref import text

    try:
        print(text(section), end="")
    except KeyError as e:
        print(f"asyncrl: error: --help-config: {e.args[0]}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _usage_error(e: Exception) -> int:
    print(f"asyncrl: error: {e}", file=sys.stderr)
    return EXIT_USAGE


def preflight(cfg) -> None:
    """What can be checked without Ray: the model directory, LoRA's target modules, every dataset row, the reward, the
    group filter, the agent loop (``rollout.agent``: it imports, has its methods, builds; a
    `ToolEnv`'s chat template)."""
    from asyncrl import data

    if cfg.model.path is not None:
        data.check_model_dir(cfg.model.path)
    if cfg.trainer.lora.enabled:
        from asyncrl.config import ConfigError
        from asyncrl.trainer.lora import check_targets

        try:
            check_targets(cfg.model_path, cfg.trainer.lora)  # the model built on the meta device: no weights read
        except ValueError as e:
            raise ConfigError(str(e)) from None
    sets = {name: data.read_rows(path) for name, path in (("train", cfg.data.train), ("val", cfg.data.val)) if path}
    if cfg.data.reward is not None:
        data.load_reward(cfg.data.reward)
    from asyncrl.config import ConfigError
    from asyncrl.rollouter import filters

    try:
        filters.load(cfg.rollout.group_filter)  # a user's module:function imports here, before Ray
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.rollout.agent.enabled:
        from asyncrl.agent import AgentSpecError
        from asyncrl.rollouter.agents import check_agent

        try:
            check_agent(cfg.rollout.agent, cfg.model_path)
        except AgentSpecError as e:
            raise ConfigError(str(e)) from None
    chat = {name: rows for name, rows in sets.items() if any(not isinstance(r.prompt, str) for r in rows)}
    if chat and cfg.model.path is None:
        name = next(iter(chat))
        raise data.DataError(f"{getattr(cfg.data, name)}: chat-message prompts need a model with a chat template; "
                             "the built-in demo model has none (set model.path)")
    if chat:
        from asyncrl.models import load_tokenizer

        tokenizer = load_tokenizer(cfg.model.path)
        for name, rows in chat.items():
            data.check_renderable(tokenizer, rows, getattr(cfg.data, name))


def dry_run(plan) -> str:
    """Reserve the plan's placement groups (no process starts), describe them, release them."""
    plan.reserve()  # checks that Ray put every bundle on its planned node
    plan.release()
    return plan.describe() + "\nplacement groups reserved and released: the plan fits the cluster"


def _run_dir(cfg, *, resume: bool) -> Path:
    """The run directory; one holding a checkpoint is continued only when asked (``--resume``)."""
    from asyncrl.config import ConfigError

    run_dir = Path(cfg.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    if not resume and (run_dir / "checkpoints" / "latest").exists():
        raise ConfigError(f"run_dir {run_dir} holds a checkpoint already: --resume {run_dir} continues that "
                          "run; or choose another --run-dir")
    return run_dir


def _make_run_dir(run_dir: Path, resolved) -> None:
    from omegaconf import OmegaConf

    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(resolved, run_dir / "config.yaml")


async def run(cfg, plan, run_dir: Path) -> int:
    """Start every process on its planned place, train to step ``cfg.steps``, close everything.

    The first SIGINT/SIGTERM stops cleanly: the step in hand is finished or abandoned, a
    checkpoint written, the processes closed in order, exit 0. A second one stops at once.
    """
    from asyncrl.processes import start
    from asyncrl.progress import train
    from asyncrl.shutdown import EXIT_INTERRUPTED, GracefulStop

    from asyncrl.hang import Watchdog, watch

    procs, hung = None, False

    def on_stop() -> None:
        if procs is not None:
            procs.trainer.request_stop()
        else:
            stop.task.cancel()  # still starting: nothing to checkpoint

    stop = GracefulStop(on_stop)
    try:
        with stop:
            procs = await start(cfg, plan, run_dir)                                # start
            if stop.requested:
                procs.trainer.request_stop()
            training = asyncio.ensure_future(train(                                 # run
                procs.trainer, cfg.steps, run_dir, procs.rollout_run, n=cfg.rollout.n,
                validate=procs.validate if cfg.data.val else None, val_every=cfg.data.val_every,
                report=procs.metrics.reporter.after_step if procs.metrics else None, rollouter=procs.rollouter))
            dog = asyncio.ensure_future(watch(procs.trainer, run_dir, Watchdog(
                cfg.watchdog_s, cfg.watchdog_factor, cfg.watchdog_floor_s, cfg.watchdog_startup_s)))
            done: set = set()
            try:
                done, _ = await asyncio.wait({training, dog}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                dog.cancel()
                if training not in done:  # a hang, or this run cancelled
                    training.cancel()
                    await asyncio.gather(training, return_exceptions=True)
            if training not in done:
                hung = True
                raise dog.result()  # a HangError: the run is started again (max_restarts)
            training.result()
            print(await procs.rollout_summary(), flush=True)
            if stop.requested:
                print(f"asyncrl: stopped cleanly at step {procs.trainer.step} ({stop.requested}); continue with: "
                      f"python -m asyncrl.launch --resume {run_dir}", flush=True)
        return 0
    except asyncio.CancelledError:
        if stop.hard is not None:
            return EXIT_INTERRUPTED
        if stop.requested is not None:
            print(f"asyncrl: stopped while starting ({stop.requested})", flush=True)
            return 0
        raise
    finally:
        if procs is not None:
            await procs.close(drain=stop.hard is None and not hung)       # close (a hung run: at once)


if __name__ == "__main__":
    sys.exit(main())
