"""The launcher's command line: flags and dotted overrides in any order."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.launch import overrides_of, parse_args


@pytest.mark.parametrize("argv", [
    ["rollout.n=4", "--steps", "3", "trainer.optim.lr=1e-3"],
    ["--steps", "3", "rollout.n=4", "trainer.optim.lr=1e-3"],
    ["rollout.n=4", "trainer.optim.lr=1e-3", "--steps", "3"],
])
def test_overrides_are_taken_anywhere_on_the_line(argv):
    args = parse_args(argv)
    assert args.overrides == ["rollout.n=4", "trainer.optim.lr=1e-3"] and args.steps == "3"
    cfg, _ = load_config([], overrides_of(args))
    assert (cfg.rollout.n, cfg.trainer.optim.lr, cfg.steps) == (4, 1e-3, 3)


def test_an_override_after_a_flag_still_wins_over_the_flag():
    # explicit overrides come after the flags' own, whatever their place on the line
    cfg, _ = load_config([], overrides_of(parse_args(["steps=7", "--steps", "3"])))
    assert cfg.steps == 7


def test_an_unknown_flag_between_overrides_is_still_refused(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["rollout.n=4", "--stepz", "3", "trainer.optim.lr=1e-3"])
    assert e.value.code == 2
    assert "unrecognized arguments: --stepz" in capsys.readouterr().err
