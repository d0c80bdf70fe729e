"""The launcher's progress view: a rich bar on a terminal, the log's line otherwise."""

from __future__ import annotations

import io

from rich.console import Console

from asyncrl.progress import ProgressView, step_line


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
