"""A user's env that raises on some prompts, through the real launcher (issue 50): its error is the
user's, deterministic, so no restart is spent on it (`asyncrl.usercode`).

- ``rollout.on_user_error=stop`` (the default): the run stops on the first such prompt, exit 1,
  one line naming the env, the error and the prompt, then the user's traceback; no restart
  (before, the launcher restarted twice and failed the same way each time, 52 s in).
- ``rollout.on_user_error=drop``: the run completes; each such group is recorded in
  ``samples.jsonl`` as dropped (``user_error: ...``, naming the prompt), counted per step in
  ``user_errors/dropped_groups``; the first error is printed with its traceback.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.integration.launching import Launch

BAD_ENV = '''
from asyncrl.tasks.calculator import CalculatorEnv


class BadEnv(CalculatorEnv):
    """The calculator demo's env, with a bug on the questions that start with a 7."""

    async def reset(self, prompt):
        if prompt.text.startswith("7"):
            raise ValueError(f"cannot parse {prompt.text!r}")
        return await super().reset(prompt)
'''

ARGS = ["--task", "calculator", "rollout.agent.env=bad_env:BadEnv", "--steps", "4", "--n", "2",
        "--groups-per-step", "2"]


def _launch(tmp_path, name: str, *extra: str) -> tuple[int, str]:
    (tmp_path / "bad_env.py").write_text(BAD_ENV)
    run = Launch(*ARGS, "--run-dir", str(tmp_path / name), *extra, cwd=tmp_path)
    try:
        return run.finish(), run.output
    finally:
        run.kill_all()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_env_that_raises_stops_the_run_naming_the_prompt_without_a_restart(tmp_path):
    code, out = _launch(tmp_path, "stop")
    assert code == 1, out[-3000:]
    line = re.search(r"^asyncrl: stopped, not restarting \(your code raised; a restart would meet it again\): "
                     r"rollout\.agent\.env=bad_env:BadEnv raised ValueError: cannot parse '(7\d\*\d\d=)' "
                     r"\(on prompt sample_\d+_\d+ '(7\d\*\d\d=)'\)$", out, re.M)
    assert line and line.group(1) == line.group(2), out[-3000:]
    after = out[line.end():]
    assert re.search(r'File ".*bad_env\.py", line \d+, in reset\n\s+raise ValueError', after), after[:2000]
    assert "--resume" in after and "rollout.on_user_error=drop" in after
    assert "asyncrl: restart " not in out and not (tmp_path / "stop" / "restarts.jsonl").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dropping_user_errors_completes_the_run_counting_each(tmp_path):
    code, out = _launch(tmp_path, "drop", "rollout.on_user_error=drop")
    assert code == 0, out[-3000:]
    assert "step   4/4" in out
    run_dir = tmp_path / "drop"
    records = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    dropped = [r for r in records if r["status"] == "dropped"]
    assert dropped, "no prompt of the run started with a 7"
    for r in dropped:
        assert re.fullmatch(r"user_error: rollout\.agent\.env=bad_env:BadEnv raised ValueError: cannot parse "
                            rf"'7\d\*\d\d=' \(on prompt {r['sample_id']} '7\d\*\d\d='\)", r["reason"]), r
    assert sum(r["status"] == "trained" for r in records) == 4 * 2
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["user_errors/dropped_groups"] for m in steps) == len(dropped)
    assert out.count("asyncrl: rollout.on_user_error=drop: dropped a group: ") == 1  # the first, with its traceback
    assert re.search(r'File ".*bad_env\.py", line \d+, in reset', out)
    assert "asyncrl: restart " not in out
