"""The README's agent-loop example, as a newcomer runs it: its code block saved under the file name
the README gives, its commands run from that directory through the real launcher (Ray, subprocesses),
then the run killed and resumed.

The README is parsed, not copied: the test follows the example if it changes. The one change to
the printed command is ``--steps`` (20 instead of 3): the default ``trainer.checkpoint_every`` is
``min(10, steps)``, so a 20-step run holds a checkpoint at step 10 while conversations are in
flight. The launcher's process group is then SIGKILLed (a crash, not a clean stop), the run is
resumed with ``--resume <run_dir>`` from the same directory, and:

- every prompt's group is trained exactly once across the crash (`check_exactly_once`), and the
  checkpoint the resume started from held conversations admitted but not trained (regenerated);
- each trained group lists one ``turns`` and ``masked_tokens`` entry per trajectory (``--n``),
  turns within ``rollout.agent.max_turns``, tokens masked out of the loss exactly when the
  conversation had more than one turn (observations between turns);
- some conversation had more than one turn (the example runs the calculator task's shipped model,
  warm-started to call the tool on part of its answers: about half the conversations of a run do):
  in its transcript (``transcripts.jsonl``, decoded with the run's tokenizer) every turn the model
  sampled is trained (mask 1), each but the last holds the call that asked for the next, and the
  tool's answer between two turns is masked out (mask 0).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.integration.launching import ROOT, Launch, check_exactly_once, sidecar

STEPS = 20  # a checkpoint at step 10 (trainer.checkpoint_every defaults to min(10, steps)), then 10 more


def agent_section(readme: str) -> str:
    """The README's agent-loop section ("Train your env or agent loop"): from its heading to the next
    heading of its level or above."""
    start = re.search(r"^(#+) .*\bagent loop\b.*$", readme, re.M | re.I)
    assert start, "README.md has no agent-loop section"
    level = len(start.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(readme, start.end())
    return readme[start.end():end.start() if end else len(readme)]


def code_blocks(markdown: str) -> list[tuple[str, str, str]]:
    """Every fenced code block as (language, code, the prose before it since the previous block)."""
    out, prose_from = [], 0
    for m in re.finditer(r"^```(\w*)\n(.*?)^```$", markdown, re.M | re.S):
        out.append((m.group(1), m.group(2), markdown[prose_from:m.start()]))
        prose_from = m.end()
    return out


def commands(bash: str) -> list[list[str]]:
    """The shell lines of a bash block (continuations joined, comments dropped), each split into words."""
    lines = bash.replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if shlex.split(line, comments=True)]


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced (the flag must be there: the test changes only what the README printed)."""
    assert flag in args, f"the README's command has no {flag}: {shlex.join(args)}"
    i = args.index(flag)
    return [*args[:i + 1], value, *args[i + 2:]]


def newcomers_files(tmp_path: Path) -> tuple[list[list[str]], list[str]]:
    """Saves the README example's Python files under ``tmp_path``; returns the commands before
    the launch and the launch's arguments (after ``python -m asyncrl.launch``)."""
    blocks = code_blocks(agent_section((ROOT / "README.md").read_text()))
    python = [(code, prose) for lang, code, prose in blocks if lang == "python"]
    assert python, "the README's agent-loop section has no python block"
    for code, prose in python:
        names = re.findall(r"`([\w/]+\.py)`", prose)
        assert names, f"no file name (`name.py`) before the README's agent example:\n{prose[-300:]}"
        (tmp_path / names[-1]).write_text(code)
    bash = [cmd for lang, code, _ in blocks if lang == "bash" for cmd in commands(code)]
    launch = [i for i, cmd in enumerate(bash) if cmd[:3] == ["python", "-m", "asyncrl.launch"]]
    assert len(launch) == 1, f"expected one launch command in the agent-loop section, got {bash}"
    return bash[:launch[0]], bash[launch[0]][3:]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_readme_agent_example_runs_as_printed_and_a_crash_resumes_exactly_once(tmp_path, monkeypatch):
    setup, args = newcomers_files(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for cmd in setup:  # e.g. saving the tiny chat model
        assert cmd[0] == "python", f"the README's setup command is not a python one: {shlex.join(cmd)}"
        done = subprocess.run([sys.executable, *cmd[1:]], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, f"{shlex.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
    args = with_flag(args, "--steps", str(STEPS))
    n = int(args[args.index("--n") + 1])
    groups = int(args[args.index("--groups-per-step") + 1])
    max_turns = int(next(a for a in args if a.startswith("rollout.agent.max_turns=")).split("=")[1])
    runs: list[Launch] = []
    try:
        run = Launch(*args, cwd=tmp_path)
        runs.append(run)
        run_dir = Path(run.wait_line("asyncrl: run dir ").split()[3].rstrip(";"))
        run.wait_step(STEPS // 2)  # the checkpoint of step 10 is written before its line
        family = psutil.Process(run.proc.pid).children(recursive=True)
        os.killpg(run.proc.pid, signal.SIGKILL)  # a crash: the launcher and whatever shares its group
        run.proc.wait()
        for p in family:  # the Ray processes in their own groups, by pid
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(family, timeout=60)
        state = sidecar(run_dir)
        assert STEPS // 2 <= state["step"] < STEPS, state["step"]
        feed = state["rollouter_state"]
        assert feed["in_flight"] or feed["unacked"], f"no conversation admitted and untrained at the checkpoint: {feed}"

        run = Launch("--resume", str(run_dir), cwd=tmp_path)
        runs.append(run)
        assert run.restored_step() == state["step"]
        assert run.finish() == 0, run.output[-3000:]
        assert f"step {STEPS:3d}/{STEPS}" in run.output, run.output[-3000:]
    finally:
        for r in runs:
            r.kill_all()

    check_exactly_once(run_dir, steps=STEPS, groups=groups)
    trained = [r for r in map(json.loads, (run_dir / "samples.jsonl").read_text().splitlines())
               if r["status"] == "trained"]
    for r in trained:  # one entry per conversation; observation tokens are masked exactly when there were some
        assert len(r["turns"]) == len(r["masked_tokens"]) == n, r
        assert all(1 <= t <= max_turns for t in r["turns"]), r
        assert all((m > 0) == (t > 1) for t, m in zip(r["turns"], r["masked_tokens"])), r
    monkeypatch.chdir(tmp_path)  # (a model directory the README names is relative to where it ran)
    check_multi_turn_transcripts(run_dir)


def check_multi_turn_transcripts(run_dir: Path) -> None:
    """At least one conversation of more than one turn, and in each: the turns the model sampled
    trained (each but the last holds its tool call), the tool answers between them masked out."""
    from asyncrl.transcripts import read, run_tokenizer, segments

    multi = [r for r in read(run_dir) if r["turns"] >= 2]
    assert multi, "no conversation had a second turn: no observation between turns was ever masked out"
    tokenizer = run_tokenizer(run_dir)
    for r in multi:
        parts = segments(tokenizer, r)
        trained = [text for text, on in parts if on]
        masked = [text for text, on in parts if not on]
        assert parts[0][1] and len(trained) == r["turns"], (r["turns"], parts)  # a trained run per turn, apart
        assert len(masked) in (r["turns"] - 1, r["turns"]), parts  # (an answer may end a conversation cut short)
        for turn, answer in zip(trained, masked):
            assert "<tool_call>" in turn and "<tool_response>" in answer, parts
