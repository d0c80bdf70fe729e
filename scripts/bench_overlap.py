"""Overlap: does a fully async step cost max(generate, train), or their sum?

One run, three parts, on one workload and with the launcher's config for the same flags
(`asyncrl.launch.parse_args`, `asyncrl.config.load_config`):

(a) generation alone: the launcher's engine actor(s) (its placement, engine kwargs and torch
    threads) fed by the real `Rollouter` in this process: the launcher's requests (dataset
    order, n, sampling, per-request seeds, ``rollout.max_concurrent`` prompts in flight,
    rewards). Its staleness gate is opened wide, as if a Trainer took each group the moment it
    is done, so generation never drains between steps: a step is the time until each further
    ``groups_per_step`` groups are done.
(b) training alone: the launcher's Trainer (its rank actor(s) and `TrainerConfig`: micro-batches,
    optimizer, a checkpoint every ``trainer.checkpoint_every`` steps) on the groups recorded in
    (a), with the weight sync into (a)'s engines (idle now) after every step, as the launcher
    runs it: a step is collect (from memory) + update + sync + checkpoint, the Trainer's side of
    an async step. The launcher's syncer also tells the Rollouter before and after each sync
    (two Ray calls); (b) has no Rollouter to tell.
(c) the async pipeline: ``python -m asyncrl.launch`` with the same flags, in its own Ray. Its
    steady state: ``timing_s/step`` (from the end of one step to the end of the next) of steps
    ``--from-step``..N in ``<run_dir>/metrics.jsonl``, and which side bounded each of those
    steps (`asyncrl.progress.bound_side`, the ``bound`` field of the launcher's per-step line).
(d) both at once, uncoupled: (a)'s generation loop (a new Rollouter, gate open) and (b)'s
    training loop (a new Trainer on (a)'s groups again, its syncs going on from (b)'s versions and
    pausing the generating engines, as in (c)) run together on the same actors, neither feeding
    the other; generation stops when training is done. On a machine whose cores the two sides
    share, this is what sharing costs each side before any hand-off: the best (c) can do.

Threads: the local Ray the launcher starts (`asyncrl.placement.connect`) gives every actor
``OMP_NUM_THREADS=1``, so the engine and the trainer rank each run torch on one thread; (a) and
(b) start Ray the same way and place their actors by the launcher's plan, so every part has the
launcher's budget (one thread per engine replica and per rank; the Rollouter's loop, here in
this process, in (c) in its own actor).

Per step, means over each part's window ((a), (b) and (d) after their first ``--warmup`` steps; (c)
from ``--from-step``): ``gen_s``, ``train_s``, ``async_s``. Means, not medians: the steps of (a)
and (c) are coupled (a slow step leaves groups done early for the next, which is then fast), so
a median understates what a step costs, and (c)'s checkpoint steps are part of its cost as
(b)'s are of its own (one in 8 steps each, by default). ``overlap`` = max(gen_s, train_s) /
async_s (target >= 0.9: the pipeline costs its slower side and little more), ``vs_serial`` =
(gen_s + train_s) / async_s (what the overlap buys over a generate-then-train loop of the same
parts: 2 at best). With ``--json`` the last line is one JSON object with these and the medians
(``gen_median_s``, ``train_median_s``, ``async_median_s``), (d)'s means ``gen_shared_s``,
``train_shared_s``, ``update_shared_s`` and ``shared_s`` (their max), ``overlap_vs_shared`` =
shared_s / async_s (what the pipeline's coupling costs beyond sharing the cores), ``gen_tok_s`` and
``response_len_mean`` (of (a)), ``async_tok_s``, ``async_len_mean``, ``update_s`` and ``sync_s``
(parts of train_s), ``async_update_s`` (the same update inside (c): the slowdown is what
sharing the cores costs), ``trainer_wait`` and ``engine_idle`` (fractions of (c)'s window the
Trainer waited for groups, the engines had no request), ``bound`` (the most common side over
(c)'s steps) and ``bound_counts``, ``steps`` (of (c), measured), ``load_1m``.

Default workload (issue 27, a new user's first run): their own model, a random Qwen2 of 4
layers, 128 wide, 4 heads over 2 KV heads with the character tokenizer
(`asyncrl.models.tiny.build_tiny_model`), built in a temp dir; 512 additions ``a+b=`` with
a, b <= 99 as verl-layout JSONL; the reward ``asyncrl.tasks.arithmetic:reward``, which reads the
sum; ``--max-tokens 64 --n 8 --groups-per-step 8 --lr 1e-4 --steps 20``, defaults otherwise.

    python scripts/bench_overlap.py --json
    python scripts/bench_overlap.py --model DIR --dataset train.jsonl --reward pkg.mod:fn --steps 30
    python scripts/bench_overlap.py rollout.max_concurrent=16     # any launcher override, all parts
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REWARD = "asyncrl.tasks.arithmetic:reward"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="launcher overrides, for every part")
    p.add_argument("--model", default=None, help="HF model dir (default: the issue's 4-layer model, built in a temp dir)")
    p.add_argument("--dataset", default=None, help="verl-layout JSONL/parquet (default: 512 additions a+b=)")
    p.add_argument("--reward", default=None, help=f"module:function (default with the default dataset: {DEFAULT_REWARD})")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=20, help="steps of the async run (c)")
    p.add_argument("--from-step", type=int, default=5, help="(c)'s steady state: steps from this one to the last")
    p.add_argument("--alone-steps", type=int, default=10, help="steps of (a) and (b) each")
    p.add_argument("--warmup", type=int, default=2, help="first steps of (a) and (b) left out")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = p.parse_args(argv)
    if args.dataset is not None and args.reward is None:
        p.error("--dataset needs --reward (module:function)")
    if not 1 <= args.from_step <= args.steps:
        p.error(f"--from-step must be in 1..--steps ({args.steps}), got {args.from_step}")
    if not 0 <= args.warmup < args.alone_steps:
        p.error(f"--warmup must be in 0..--alone-steps - 1, got {args.warmup}")
    return args


def launcher_argv(args: argparse.Namespace, tmp: Path) -> list[str]:
    """The launcher's flags for the run, building the default model and dataset in ``tmp``."""
    from asyncrl.models.tiny import build_tiny_model
    from asyncrl.tasks import arithmetic
    from bench_engine import USER_MODEL  # the model, as bench_engine's short workload has it

    model = args.model or str(build_tiny_model(tmp / "model", **USER_MODEL))
    dataset, reward = args.dataset, args.reward or DEFAULT_REWARD
    if dataset is None:
        dataset = tmp / "train.jsonl"
        rows = arithmetic.generate_dataset(512, seed=0, config=arithmetic.ArithmeticTaskConfig(max_operand=99))
        dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["--model", str(model), "--dataset", str(dataset), "--reward", reward, "--max-tokens", str(args.max_tokens),
            "--n", str(args.n), "--groups-per-step", str(args.groups_per_step), "--lr", str(args.lr),
            "--steps", str(args.steps), "--run-dir", str(tmp / "run"), *args.overrides]


# ------------------------------------------------------------------------------ (a) and (b)


async def run_alone(argv: list[str], steps: int, tmp: Path, shared: bool = True) -> dict:
    """(a), (b), then (d) on the launcher's actors: ``gen_s`` per step, the ``groups`` (in completion
    order), ``trained`` (per step: ``step_s``, ``update_s``, ``sync_s``), ``per_step`` (groups in a
    step); with ``shared``, (d)'s ``gen_shared_s`` and ``trained_shared``."""
    import ray

    from asyncrl import placement
    from asyncrl.config import load_config
    from asyncrl.launch import config_layers
    from asyncrl.launch import parse_args as launch_args
    from asyncrl.processes import _pad_token_id
    from asyncrl.rollouter.actor import remote_engine_actor
    from asyncrl.sync import WeightSyncCoordinator
    from asyncrl.trainer.ranks import RankGroup

    cfg, _ = load_config(*config_layers(launch_args(argv)))
    model = cfg.model.path
    cluster = placement.connect(cfg.placement, cpu_actors=cfg.engine_replicas + cfg.trainer_world_size + 1)
    plan, engines, ranks = None, [], None
    try:
        plan = placement.make_plan(cfg, cluster)
        plan.reserve()
        engines = [remote_engine_actor(**plan.options(slot)).remote(kind=cfg.engine_kind, **cfg.engine_kwargs(model))
                   for slot in plan.engines]
        tcfg = cfg.trainer_config(model_path=model, pad_token_id=_pad_token_id(model),
                                  checkpoint_dir=str(tmp / "alone" / "checkpoints"),
                                  samples_path=str(tmp / "alone" / "samples.jsonl"))
        ranks = RankGroup.start_ray(tcfg, actor_options=[plan.options(s) for s in plan.ranks])  # engines start meanwhile
        await asyncio.gather(*(e.ready.remote() for e in engines))
        gen_s, groups = await generate_alone(cfg, engines, steps)
        coordinator = WeightSyncCoordinator(ranks.workers, engines, cfg.weight_sync_config())
        trained = await train_alone(tcfg, ranks, coordinator, groups)
        out = {"gen_s": gen_s, "groups": groups, "trained": trained, "per_step": cfg.groups_per_step}
        if shared:
            # (d): both loops at once on the same actors, each on its own input; the syncs
            # (versions going on from (b)'s) pause and resume the generating engines.
            again = dataclasses.replace(tcfg, checkpoint_dir=str(tmp / "shared" / "checkpoints"),
                                        samples_path=str(tmp / "shared" / "samples.jsonl"))
            training = asyncio.ensure_future(train_alone(again, ranks, coordinator, groups))
            out["gen_shared_s"], _ = await generate_alone(cfg, engines, steps, until=training)
            out["trained_shared"] = training.result()
        return out
    finally:
        if ranks is not None:
            ranks.close()
        for e in engines:
            ray.kill(e)
        if plan is not None:
            plan.release()
        placement.disconnect(cluster)


async def generate_alone(cfg, engines: list, steps: int, until: asyncio.Future | None = None) -> tuple[list[float], list]:
    """(a): ``steps`` steps' groups through the Rollouter, its gate never closed; the time of each step's groups.

    With ``until`` ((d)): generate on until ``until`` is done, then stop; the steps done by then."""
    from transformers import AutoTokenizer

    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.rollouter import Rollouter
    from asyncrl.rollouter.worker import DataSpec, load_prompts, make_reward_fn

    class TimedSink(MemorySink):
        """The stream's stand-in: keeps every group and when it was done."""

        def __init__(self):
            super().__init__()
            self.times: list[float] = []

        async def send(self, group) -> None:
            self.times.append(time.perf_counter())
            await super().send(group)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    spec = DataSpec(train=cfg.data.train, reward=cfg.data.reward, seed=cfg.seed, long_tail=cfg.data.long_tail)
    per_step = cfg.groups_per_step
    # A run-ahead of every step at once: only max_concurrent bounds what is in flight, as with a
    # Trainer that takes each group and syncs at once.
    # (d) generates for as long as training runs: a budget no run reaches.
    rollout = dataclasses.replace(cfg.rollout_config(), staleness_threshold=float(steps if until is None else 10**9))
    sink = TimedSink()
    rollouter = Rollouter(rollout, engines, sink, load_prompts(tokenizer, spec), make_reward_fn(tokenizer, spec))
    t0 = time.perf_counter()
    run = asyncio.ensure_future(rollouter.run(num_groups=steps * per_step if until is None else None))
    if until is not None:
        await asyncio.wait([run, until], return_when=asyncio.FIRST_COMPLETED)
        if not until.done():
            await run  # generation ended first: raises what ended it
            raise RuntimeError("(d): generation ended before training was done")
        end = time.perf_counter()
        await rollouter.stop()
        await run
        sink.times = [t for t in sink.times if t <= end]
    else:
        await run
    ends = [t0, *sink.times[per_step - 1::per_step]]
    return [b - a for a, b in zip(ends, ends[1:])], sink.groups


async def train_alone(tcfg, ranks, coordinator, groups: list) -> list[dict]:
    """(b): the Trainer on ``groups``, a weight sync into the engines after every step; per-step figures."""
    from asyncrl.queue.memory import MemorySource
    from asyncrl.trainer.trainer import Trainer

    trainer = Trainer(tcfg, ranks, MemorySource(groups), coordinator)
    out = []
    for _ in range(len(groups) // (tcfg.groups_per_batch * tcfg.require_batches)):
        t0 = time.perf_counter()
        m = (await trainer.train_step()).metrics
        out.append({"step_s": time.perf_counter() - t0, "update_s": m["timing_s/update_actor"],
                    "sync_s": coordinator.last.total_s if trainer.step % tcfg.trigger_parameter_sync_step == 0 else 0.0})
    return out


# ----------------------------------------------------------------------------------- (c)


def run_async(argv: list[str], run_dir: Path) -> list[dict]:
    """(c): the launcher's run; its metrics.jsonl rows."""
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch", *argv], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the async run failed ({out.returncode}):\n{(out.stdout + out.stderr)[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# -------------------------------------------------------------------------------- report


def summarize(args, alone: dict, rows: list[dict]) -> dict:
    from asyncrl.progress import bound_side

    w, groups, trained = args.warmup, alone["groups"], alone["trained"]
    gen = alone["gen_s"][w:]
    train = [t["step_s"] for t in trained[w:]]
    steady = [r for r in rows if r["step"] >= args.from_step]
    step = [r["timing_s/step"] for r in steady]
    measured = groups[w * alone["per_step"]:]  # in completion order: the groups of (a)'s measured steps
    bounds = collections.Counter(bound_side(r) or "unknown" for r in steady)
    out = {"gen_s": statistics.mean(gen), "train_s": statistics.mean(train), "async_s": statistics.mean(step)}
    out["overlap"] = max(out["gen_s"], out["train_s"]) / out["async_s"]
    out["vs_serial"] = (out["gen_s"] + out["train_s"]) / out["async_s"]
    out.update({
        "gen_median_s": statistics.median(gen), "train_median_s": statistics.median(train),
        "async_median_s": statistics.median(step),
        "gen_tok_s": sum(len(t.response_ids) for g in measured for t in g.trajectories) / sum(gen),
        "response_len_mean": statistics.mean(len(t.response_ids) for g in groups for t in g.trajectories),
        "async_tok_s": sum(r["groups"] * args.n * r["response_length_mean"] for r in steady) / sum(step),
        "async_len_mean": statistics.mean(r["response_length_mean"] for r in steady),
        "update_s": statistics.mean(t["update_s"] for t in trained[w:]),
        "sync_s": statistics.mean(t["sync_s"] for t in trained[w:]),
        "async_update_s": statistics.mean(r["timing_s/update_actor"] for r in steady),
        "trainer_wait": sum(r["timing_s/wait_data"] for r in steady) / sum(step),
        "engine_idle": sum(r.get("timing_s/rollouter/idle", float("nan")) for r in steady) / sum(step),
    })
    if "gen_shared_s" in alone:
        gen_d, train_d = alone["gen_shared_s"][w:], [t["step_s"] for t in alone["trained_shared"][w:]]
        out.update(gen_shared_s=statistics.mean(gen_d) if gen_d else float("nan"), train_shared_s=statistics.mean(train_d),
                   update_shared_s=statistics.mean(t["update_s"] for t in alone["trained_shared"][w:]))
        out["shared_s"] = max(out["gen_shared_s"], out["train_shared_s"])
        out["overlap_vs_shared"] = out["shared_s"] / out["async_s"]
    out = {k: round(v, 4) for k, v in out.items()}
    out.update(bound=bounds.most_common(1)[0][0], bound_counts=dict(bounds), steps=len(steady))
    return out


def _seconds(xs) -> str:
    return " ".join(f"{x:.2f}" for x in xs)


def main() -> None:
    args = parse_args()
    load = os.getloadavg()
    print(f"bench_overlap: {args.groups_per_step} groups x n={args.n}, max tokens {args.max_tokens}; (a), (b) "
          f"{args.alone_steps} steps each, (c) {args.steps} steps, steady from step {args.from_step}; load average "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        argv = launcher_argv(args, tmp)
        t0 = time.perf_counter()
        alone = asyncio.run(run_alone(argv, args.alone_steps, tmp))
        print(f"  (a) generation alone, s per step: {_seconds(alone['gen_s'])}\n  (b) training alone, s per step: "
              f"{_seconds(t['step_s'] for t in alone['trained'])}\n  (d) both at once, uncoupled: generation "
              f"{_seconds(alone['gen_shared_s'])}; training {_seconds(t['step_s'] for t in alone['trained_shared'])}  "
              f"(wall {time.perf_counter() - t0:.0f} s)", flush=True)
        t0 = time.perf_counter()
        rows = run_async(argv, tmp / "run")
        print(f"  (c) async pipeline, s per step: {_seconds(r['timing_s/step'] for r in rows)}  "
              f"(wall {time.perf_counter() - t0:.0f} s)", flush=True)
    out = summarize(args, alone, rows)
    out["load_1m"] = round(load[0], 2)  # before the run's own processes
    print(f"per step (mean): generate {out['gen_s']:.3f} s ({out['gen_tok_s']:.0f} tok/s, len "
          f"{out['response_len_mean']:.1f}), train {out['train_s']:.3f} s (update {out['update_s']:.3f}, sync "
          f"{out['sync_s']:.3f}), async {out['async_s']:.3f} s ({out['async_tok_s']:.0f} tok/s, len "
          f"{out['async_len_mean']:.1f}, update {out['async_update_s']:.3f}); overlap {out['overlap']:.2f} (target "
          f">= 0.9), vs serial {out['vs_serial']:.2f}; medians {out['gen_median_s']:.3f} / {out['train_median_s']:.3f} "
          f"/ {out['async_median_s']:.3f} s", flush=True)
    print(f"both at once, uncoupled (d): generate {out['gen_shared_s']:.3f} s, train {out['train_shared_s']:.3f} s "
          f"(update {out['update_shared_s']:.3f}): sharing the cores costs the slower side x"
          f"{out['shared_s'] / max(out['gen_s'], out['train_s']):.2f}; the pipeline's own cost on top: overlap_vs_shared "
          f"{out['overlap_vs_shared']:.2f}", flush=True)
    print(f"async steps bound by {out['bound']} {out['bound_counts']}: the Trainer waited {out['trainer_wait']:.0%} "
          f"of the time, the engines idled {out['engine_idle']:.0%}; load average now {os.getloadavg()[0]:.1f}", flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
