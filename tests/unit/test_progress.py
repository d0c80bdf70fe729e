"""The launcher's progress view: a rich bar on a terminal, the log's line otherwise."""

from __future__ import annotations

import io

from rich.console import Console

from asyncrl.progress import ProgressView, bound_side, rollouter_step_metrics, step_line


def metrics(step: int, **extra) -> dict:
    return {"step": step, "version": step, "reward_mean": 0.25 * step, "loss": -0.01, "staleness_mean": 0.5,
            "response_length_mean": 4.0, "tokens_per_s": 123.0, "time_s": 2.0 * step, **extra}


def test_bar_shows_step_reward_staleness_and_tokens_per_s():
    out = io.StringIO()
    view = ProgressView(3, live=True, console=Console(file=out, force_terminal=True, width=160))
    view.update(metrics(2))
    view.close()
    text = out.getvalue()
    assert "2/3" in text and "reward 0.500" in text and "staleness 0.50" in text and "123 tok/s" in text


def test_without_a_terminal_each_step_is_one_line(capsys):
    view = ProgressView(3, live=False)
    view.update(metrics(1, **{"val/reward_mean": 0.75}))
    view.close()
    line = capsys.readouterr().out.strip()
    assert line == step_line(metrics(1, **{"val/reward_mean": 0.75}), 3)
    assert line.startswith("step   1/3") and line.endswith("val/reward 0.750")


def timed(step_s: float, wait_s: float, idle_s: float) -> dict:
    return {"timing_s/step": step_s, "timing_s/wait_data": wait_s, "timing_s/rollouter/idle": idle_s}


def test_bound_side_names_the_side_the_other_waited_for():
    assert bound_side(timed(1.0, 0.5, 0.0)) == "engine"  # the Trainer waited for groups half the step
    assert bound_side(timed(1.0, 0.01, 0.3)) == "trainer"  # the engines idled at the gate
    assert bound_side(timed(1.0, 0.19, 0.19)) == "both"  # neither waited a fifth of the step
    assert bound_side(timed(1.0, 0.4, 0.5)) == "handoff"  # each waited for the other (sync mode)
    assert bound_side(timed(2.0, 0.4, 0.0)) == "engine" and bound_side(timed(2.0, 0.39, 0.0)) == "both"
    assert bound_side({"timing_s/step": 1.0, "timing_s/wait_data": 0.5}) is None  # no Rollouter figures


def test_step_line_and_bar_say_the_bound_only_when_known(capsys):
    assert "bound" not in step_line(metrics(1), 3)  # a step without the timings: no field, no error
    line = step_line(metrics(2, **timed(1.0, 0.6, 0.0), **{"val/reward_mean": 0.5}), 3)
    assert "  bound engine  val/reward 0.500" in line
    assert "turns" not in line  # single-turn responses
    assert "  turns 2.8  bound engine" in step_line(metrics(2, **timed(1.0, 0.6, 0.0), **{"agent/turns_mean": 2.75}), 3)
    out = io.StringIO()
    view = ProgressView(3, live=True, console=Console(file=out, force_terminal=True, width=200))
    view.update(metrics(2, **timed(1.0, 0.0, 0.5)))
    view.close()
    assert "bound trainer" in out.getvalue()


def test_rollouter_share_of_a_step_is_the_difference_of_two_readings():
    last = {"gate_blocked_s": 1.0, "credit_blocked_s": 0.5, "idle_s": 2.0, "truncated": 3, "resumed": 1, "timed_out": 0}
    now = {**last, "gate_blocked_s": 1.25, "idle_s": 2.5, "truncated": 4, "waiting_partials": 2}
    m = rollouter_step_metrics(last, now)
    assert m["timing_s/rollouter/gate_blocked"] == 0.25 and m["timing_s/rollouter/idle"] == 0.5
    assert m["timing_s/rollouter/credit_blocked"] == 0.0 and m["fully_async/partial/truncated"] == 1.0
    assert rollouter_step_metrics(last, {}) == {}
    # The engines' counters: the step's group calls, their distinct prompt tokens and what was prefilled.
    last["engine_counters"] = {"groups": 2, "group_prompt_tokens": 12, "group_prefill_tokens": 12}
    now.update(requests_spread=0.1, engine_counters={"groups": 6, "group_prompt_tokens": 40, "group_prefill_tokens": 40})
    m = rollouter_step_metrics(last, now)
    assert m["engine/prefill_tokens_per_group"] == m["engine/prompt_tokens_per_group"] == 7.0
    assert m["engine/requests_spread"] == 0.1
