"""The launcher's *run*: train the steps, watch the Rollouter, show progress, write metrics and the log.

Each step appends its metrics to ``<run_dir>/metrics.jsonl`` and one line to
``<run_dir>/train.log``. On a terminal a rich progress bar shows the step, reward, staleness,
response tokens/s and the ETA; elsewhere (a pipe, a CI log, ``ray job submit``) the same line
as the log is printed per step. Both say which side bounded the step (`bound_side`).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.metrics.report import prefill_metrics


BOUND_WAIT = 0.2
"""A side that waited for the other this fraction of a step or more did not bound the step."""


def bound_side(m: dict) -> str | None:
    """Which side bounded a step, from how long each side waited for the other in it:

    - ``engine``: the Trainer waited for groups (``timing_s/wait_data``) for at least `BOUND_WAIT`
      of the step (``timing_s/step``), the engines less: generation is the limit;
    - ``trainer``: the engines had no request (``timing_s/rollouter/idle``: the staleness gate held
      the Rollouter until the next sync) for at least `BOUND_WAIT` of the step, the Trainer less:
      training, with its weight sync, is the limit;
    - ``both``: neither waited that long: generation and training overlap, each busy all the step;
    - ``handoff``: both did: the step lost time between them (by design in ``--mode sync``; in
      async mode, weight syncs or the stream).

    None when the step's metrics lack one of the three (no Rollouter handle, an older row).
    """
    try:
        step_s, wait_s, idle_s = m["timing_s/step"], m["timing_s/wait_data"], m["timing_s/rollouter/idle"]
    except KeyError:
        return None
    trainer_waited = wait_s >= BOUND_WAIT * step_s
    engines_waited = idle_s >= BOUND_WAIT * step_s
    if trainer_waited and engines_waited:
        return "handoff"
    return "engine" if trainer_waited else "trainer" if engines_waited else "both"


def _bound_text(m: dict) -> str:
    """``"  bound <side>"`` for a step line or the bar, or "" when the side is not known."""
    side = bound_side(m)
    return f"  bound {side}" if side else ""


def step_line(m: dict, steps: int) -> str:
    val = f"  val/reward {m['val/reward_mean']:.3f}" if "val/reward_mean" in m else ""
    turns = f"  turns {m['agent/turns_mean']:.1f}" if "agent/turns_mean" in m else ""
    if "agent/tool_calls_per_turn" in m:
        turns += f"  tools/turn {m['agent/tool_calls_per_turn']:.2f}"
    bound = _bound_text(m)
    return (f"step {m['step']:3d}/{steps}  version {m['version']:3d}  reward {m['reward_mean']:.3f}  "
            f"loss {m['loss']:+.4f}  staleness {m['staleness_mean']:.2f}  len {m['response_length_mean']:.1f}  "
            f"{m['tokens_per_s']:.0f} tok/s  {m['time_s']:.0f}s{turns}{bound}{val}")


class ProgressView:
    """A rich progress bar on a terminal, plain per-step lines otherwise."""

    def __init__(self, steps: int, live: bool | None = None, console=None):
        self.steps = steps
        self.live = sys.stdout.isatty() if live is None else live
        self._bar = None
        if self.live:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stats]}"), TimeRemainingColumn(), console=console)
            self._task = self._bar.add_task("train", total=steps, stats="waiting for the first groups")
            self._bar.start()

    def update(self, m: dict) -> None:
        if self._bar is None:
            print(step_line(m, self.steps), flush=True)
            return
        stats = (f"reward {m['reward_mean']:.3f}  staleness {m['staleness_mean']:.2f}  "
                 f"{m['tokens_per_s']:.0f} tok/s  v{m['version']}{_bound_text(m)}")
        self._bar.update(self._task, completed=m["step"], stats=stats)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def rollouter_step_metrics(last: dict, now: dict) -> dict[str, float]:
    """The Rollouter's share of a step's metrics, from two `RolloutWorker.stats` readings."""
    if not now:
        return {}
    d = {k: now[k] - last.get(k, 0.0) for k in ("gate_blocked_s", "credit_blocked_s", "idle_s", "truncated",
                                                "resumed", "timed_out")}
    return {
        "timing_s/rollouter/gate_blocked": d["gate_blocked_s"],
        "timing_s/rollouter/credit_blocked": d["credit_blocked_s"],
        "timing_s/rollouter/idle": d["idle_s"],
        "fully_async/partial/truncated": float(d["truncated"]),
        "fully_async/partial/resumed": float(d["resumed"]),
        "fully_async/partial/waiting": float(now["waiting_partials"]),
        "rollouter/timed_out": float(d["timed_out"]),
        "engine/requests_spread": float(now.get("requests_spread", 0.0)),
        **prefill_metrics(last.get("engine_counters", {}), now.get("engine_counters", {})),
        **_agent_step_metrics(last, now),
    }


def _agent_step_metrics(last: dict, now: dict) -> dict[str, float]:
    """An env loop's tool use during the step (turns the envs answered in it; nothing without one)."""
    turns = now.get("agent_turns", 0) - last.get("agent_turns", 0)
    if turns <= 0:
        return {}
    calls = now["agent_tool_calls"] - last.get("agent_tool_calls", 0)
    out = {"agent/step_turns": float(turns), "agent/step_tool_calls": float(calls),
           "agent/tool_calls_per_turn": calls / turns}
    if "agent_tool_errors" in now:  # an env loop's (an endpoint agent runs its tools itself)
        errors = now["agent_tool_errors"] - last.get("agent_tool_errors", 0)
        out.update({"agent/tool_errors_per_call": errors / max(calls, 1),
                    "agent/env_step_s_per_turn": (now["agent_env_step_s"] - last.get("agent_env_step_s", 0.0)) / turns})
    return out


class RunLog:
    """Where each finished step goes: ``metrics.jsonl``, ``train.log``, the progress view and the
    metric stream (``report``); `summary` prints the run's last lines."""

    def __init__(self, run_dir: Path, steps: int, report: Callable[[Any], None] | None = None):
        self.run_dir, self.steps, self.report = run_dir, steps, report
        self.rows: list[dict] = []
        self.done_at: list[float] = []  # when each step (and its validation) finished
        self.view = ProgressView(steps)
        self._metrics = open(run_dir / "metrics.jsonl", "a")
        self._log = open(run_dir / "train.log", "a")

    def write(self, result: Any, m: dict) -> None:
        self._metrics.write(json.dumps(m) + "\n")
        self._metrics.flush()
        self._log.write(step_line(m, self.steps) + "\n")
        self._log.flush()
        self.view.update(m)
        self.rows.append(m)
        self.done_at.append(time.monotonic())
        if self.report is not None:
            self.report(result)  # to the metric stream (asyncrl.metrics)

    def close(self) -> None:
        self.view.close()
        self._metrics.close()
        self._log.close()

    def summary(self) -> None:
        done_at, rows, run_dir = self.done_at, self.rows, self.run_dir
        if len(done_at) > 1:  # start-up and the first step excluded
            print(f"asyncrl: steps 2-{len(done_at)} took {(done_at[-1] - done_at[0]) / (len(done_at) - 1):.3f} "
                  f"s/step", flush=True)
        if rows:
            rewards = [r["reward_mean"] for r in rows]
            k = max(1, len(rewards) // 5)  # the first and last 20% of the steps
            print(f"asyncrl: mean reward of the first {k} steps {float(np.mean(rewards[:k])):.3f} -> last {k} steps "
                  f"{float(np.mean(rewards[-k:])):.3f}; metrics in {run_dir / 'metrics.jsonl'}, log in "
                  f"{run_dir / 'train.log'}, checkpoints in {run_dir / 'checkpoints'}", flush=True)


def _timing_metrics(m: dict, *, t0: float, last: float, ended: float, n: int) -> float:
    """Adds the step's wall-clock metrics to ``m``; returns when the step ended."""
    now = time.monotonic()
    m["time_s"] = round(now - t0, 2)
    m["timing_s/step"] = now - ended
    m["tokens_per_s"] = m["groups"] * n * m["response_length_mean"] / max(now - last, 1e-9)
    return now


async def _next_result(trainer: Any, step_task: asyncio.Future, rollout_task: asyncio.Future) -> Any:
    """The step's result, or the Rollouter's failure under its own name if it stopped first.

    The step in hand then ends cleanly (abandoned while collecting, or finished), so the Trainer
    can still be checkpointed.
    """
    done, _ = await asyncio.wait({step_task, rollout_task}, return_when=asyncio.FIRST_COMPLETED)
    if step_task not in done:
        trainer.request_stop()
        await asyncio.gather(step_task, return_exceptions=True)
        rollout_task.result()  # re-raises the Rollouter's failure, under its own name
        raise RuntimeError("the Rollouter stopped before training finished")
    return step_task.result()


async def train(trainer: Any, steps: int, run_dir: Path, rollout_ref: Any, *, n: int,
                validate: Callable[[int], Awaitable[dict]] | None = None, val_every: int = 10,
                report: Callable[[Any], None] | None = None, rollouter: Any = None) -> list[dict]:
    """Train until step ``steps`` (restored steps count), or until a stop is requested.

    Ends with a checkpoint whenever the Trainer can write one: at the last step, after a stop
    request, and after a failure outside the ranks' training (then re-raised). A Rollouter that
    stops first fails the run under its own name. With ``validate``, every ``val_every`` steps
    and after the last one its ``val/`` metrics join the step's metrics. With the Rollouter's
    handle, each step's metrics also hold its blocked/idle time and the truncations of the step
    (`rollouter_step_metrics`). ``timing_s/step`` is the wall time from the end of the step
    before (or the start) to the end of this one, everything between steps included.
    """
    from asyncrl.trainer.trainer import StepAbandoned

    t0 = last = ended = time.monotonic()
    last_stats: dict = {}
    rollout_task = asyncio.wrap_future(rollout_ref.future())
    rollout_task.add_done_callback(lambda f: f.cancelled() or f.exception())  # seen below, under its own name
    log = RunLog(run_dir, steps, report)
    step_task = None
    try:
        while step_task is not None or (trainer.step < steps and not trainer.stopping):
            if step_task is None:
                step_task = asyncio.ensure_future(trainer.train_step())
            try:
                result = await _next_result(trainer, step_task, rollout_task)
            except StepAbandoned:
                break
            finally:
                step_task = None
            m = result.metrics
            ended = _timing_metrics(m, t0=t0, last=last, ended=ended, n=n)
            validating = validate is not None and (m["step"] % val_every == 0 or m["step"] == steps)
            if not validating and trainer.step < steps and not trainer.stopping:
                # The next step starts now; this one's bookkeeping (a Ray call to a busy
                # Rollouter takes tens of ms) runs beside it instead of between the two.
                step_task = asyncio.ensure_future(trainer.train_step())
            if rollouter is not None:
                stats = await rollouter.stats.remote()
                m.update(rollouter_step_metrics(last_stats, stats))
                last_stats = stats
            if validating:
                m.update(await validate(m["step"]))
            last = time.monotonic()
            log.write(result, m)
    except Exception as e:
        log.close()
        if step_task is not None:  # a step started beside the failed bookkeeping ends first
            trainer.request_stop()
            await asyncio.gather(step_task, return_exceptions=True)
        await checkpoint_after_failure(trainer, e, run_dir)
        raise
    finally:
        log.close()
    await trainer.finish()
    log.summary()
    return log.rows


def newest_checkpoint(run_dir: Path) -> str:
    """The checkpoint a restart (or ``--resume``) of ``run_dir`` starts from, in words."""
    from asyncrl.trainer import checkpoint

    found = checkpoint.latest(run_dir / "checkpoints")
    return f"its checkpoint of step {found[1].step} ({found[0]})" if found else "the start (no checkpoint yet)"


async def checkpoint_after_failure(trainer: Any, error: Exception, run_dir: Path) -> None:
    """Make what the Trainer did durable before the run stops on ``error``, if its ranks allow."""
    where = f"continue with: python -m asyncrl.launch --resume {run_dir}"
    if trainer.broken:
        print(f"asyncrl: stopping on {type(error).__name__}; no new checkpoint ({trainer.broken}); {where} "
              f"(from {newest_checkpoint(run_dir)})", file=sys.stderr, flush=True)
        return
    try:
        await trainer.finish()
    except Exception as e:  # noqa: BLE001 - the original failure is what the run reports
        print(f"asyncrl: stopping on {type(error).__name__}; the checkpoint failed too ({type(e).__name__}: {e}); "
              f"{where} (from {newest_checkpoint(run_dir)})", file=sys.stderr, flush=True)
        return
    from asyncrl.usercode import user_error

    user = user_error(error)  # its one line, not the Ray error's whole remote traceback (printed once, later)
    what = f"{type(user).__name__}: {user.line()}" if user is not None else f"{type(error).__name__}: {error}"
    print(f"asyncrl: stopping on {what}\nasyncrl: checkpoint of step {trainer.step} written; {where}",
          file=sys.stderr, flush=True)
