"""The custom-role example of docs/skip.md runs as written: first run computes and dumps, a second
run (a fresh process would do the same) replays the listed steps."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

from asyncrl.skip import SkipManager

README = Path(__file__).resolve().parents[2] / "docs" / "skip.md"


def custom_role_example() -> str:
    section = README.read_text().split("## A custom role", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_as_module(code: str) -> None:
    module = types.ModuleType("readme_example")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    try:
        exec(compile(code, str(README), "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]


def test_readme_custom_role_example(tmp_path, monkeypatch, capsys):
    code = custom_role_example()
    monkeypatch.chdir(tmp_path)
    try:
        run_as_module(code)
        assert capsys.readouterr().out.splitlines() == ["computing step 0", "computing step 1", "computing step 2"]
        run_as_module(code)  # the second run
        assert capsys.readouterr().out.splitlines() == ["computing step 2"]
        assert SkipManager.stats() == {"reference_logprobs": {"replayed": 2}}
        dumps = sorted(p.parent.name for p in (tmp_path / "skip_dumps" / "default" / "reference_logprobs").rglob("meta.json"))
        assert dumps == ["step_0", "step_1"]
    finally:
        SkipManager.reset()
