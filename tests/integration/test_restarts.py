"""Whole runs through ``python -m asyncrl.launch`` that restart themselves: a frozen engine named in
the hang dump and the run started again; a seeded schedule of kills (engine, trainer rank,
Rollouter) survived with no person acting and each sample trained once; killed engine replicas
started again, taking the current weights, and serving. (Split from test_resume.py so that
pytest-xdist runs the two files' long runs side by side.)
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal

import pytest

from asyncrl.hang import WARMUP_STEPS
from asyncrl.models.tiny import build_tiny_model
from tests.integration.launching import COMMON, GROUPS, Launch, check_exactly_once


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_frozen_engine_is_named_in_the_hang_dump_and_the_run_restarts(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    # The deadline is the run's own: 10x its median step after the warm-up steps, at least 30 s.
    # A step slowed by a loaded machine stays far inside it; only a frozen engine passes it (and
    # the restarted run gets the start-up deadline, 600 s, as any start does). The weight sync's own
    # pause deadline, which a frozen engine also passes, is set past it: this test is the watchdog's
    # (on a loaded machine 10x the median step can outlast the default 60 s pause timeout).
    run = Launch("--model", str(model), "--run-dir", str(run_dir), *COMMON, "--engines", "1", "--max-restarts", "1",
                 "restart_backoff_s=0.5", "watchdog_floor_s=30", "watchdog_factor=10", "watchdog_startup_s=600",
                 "weight_sync.pause_timeout_s=900")
    frozen = None
    try:
        run.wait_step(WARMUP_STEPS + 3)  # steady steps seen: the deadline is the derived one
        frozen = run.actor_pids("EngineActor")[0]
        os.kill(frozen, signal.SIGSTOP)  # the Rollouter waits on it forever: no step completes
        run.wait_line("asyncrl: hang: no train step completed for")
        with contextlib.suppress(ProcessLookupError):  # the restart may have killed it already
            os.kill(frozen, signal.SIGCONT)
        frozen = None
        run.restored_step()
        assert run.finish() == 0, run.output[-3000:]
    finally:
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGCONT)
        run.kill_all()
    (dump,) = run_dir.glob("hang-*.txt")
    text = dump.read_text()
    summary = text.split("\n\n")[1].splitlines()  # one line per process, after the reason
    engine = [line for line in summary if line.startswith("ray::EngineActor")]
    assert engine and "no answer (state stopped): frozen" in engine[0], text[:3000]
    trainer = [line for line in summary if line.startswith("ray::TrainerWorker")]
    assert trainer and "no answer" not in trainer[0] and "(" in trainer[0], text[:3000]  # its frame, named
    assert any(line.startswith("launcher pid") for line in summary)
    assert "===== ray::RolloutWorker" in text and 'File "' in text  # the stacks themselves
    causes = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert len(causes) == 1 and causes[0]["cause"].startswith("HangError: no train step completed")
    # Taken at the freeze (a step or so after it, which the engine may have generated already), not
    # at a slow step before it, and after the derived deadline with its room.
    after = int(causes[0]["cause"].split(" after step ")[1].split(";")[0])
    deadline = float(causes[0]["cause"].split("(deadline ")[1].split(" s)")[0])
    assert after >= WARMUP_STEPS + 3 and deadline >= 30, causes[0]["cause"]
    check_exactly_once(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", [7])
def test_a_seeded_schedule_of_kills_is_survived_with_no_person_and_each_sample_trained_once(tmp_path, seed):
    """Chaos: an engine replica, a trainer rank, the Rollouter and an engine again are SIGKILLed at
    seeded steps of one 60-step run. A dead replica is started again (the next test checks that it
    serves); a dead rank or Rollouter restarts the run from its checkpoint in the same command
    (max_restarts 2, the default). The run ends at step 60 with exit 0, each sample trained once."""
    rng = random.Random(seed)
    model = build_tiny_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    steps, groups = 60, GROUPS
    run = Launch("--model", str(model), "--run-dir", str(run_dir), *COMMON, "--steps", str(steps),
                 "--max-restarts", "2", "restart_backoff_s=0.5", "engine.restart_backoff_s=0.5")
    schedule = ["EngineActor", "TrainerWorker", "RolloutWorker", "EngineActor"]
    at = 0
    try:
        for victim in schedule:
            at += rng.randint(3, 6)
            run.wait_step(at)
            os.kill(rng.choice(run.actor_pids(victim)), signal.SIGKILL)
            if victim == "EngineActor":  # found dead at the next sync; the run goes on meanwhile
                assert "died" in run.wait_line("asyncrl: engine["), run.output[-3000:]
            else:
                at = run.restored_step()
            print(f"killed {victim}; going on from step {at}")
            assert at < steps - 6, run.output[-3000:]
        assert run.finish() == 0, run.output[-3000:]
    finally:
        run.kill_all()
    assert run.output.count("asyncrl: restart ") == 2, run.output[-3000:]
    causes = [json.loads(line)["cause"] for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert len(causes) == 2 and all(causes), causes
    # Each line names the process that died and the checkpoint the run goes on from (with --resume's
    # words for none), and that checkpoint is the step the restarted run restored.
    assert "a trainer rank (TrainerWorker, pid" in causes[0] and "the Rollouter (RolloutWorker, pid" in causes[1], causes
    restarts = [line for line in run.output.splitlines() if line.startswith("asyncrl: restart ")]
    restored = [int(line.split()[4].rstrip(",")) for line in run.output.splitlines()
                if line.startswith("asyncrl: resumed at step ")]
    for line, step in zip(restarts, restored, strict=True):
        assert f"from its checkpoint of step {step} (" in line and f"step_{step:06d})" in line, line
    engines = [line for line in run.output.splitlines() if line.startswith("asyncrl: engine[") and " died" in line]
    assert len(engines) == 2, run.output[-3000:]
    assert run.output.count("; starting it again (1/3)") == 2, run.output[-3000:]
    check_exactly_once(run_dir, steps, groups)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_killed_engine_replicas_start_again_take_the_current_weights_and_serve(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    steps = 300  # long enough for a replica to start again twice (~12 s each here) mid-run
    run = Launch("--model", str(model), "--run-dir", str(run_dir), *COMMON, "--steps", str(steps),
                 "engine.restart_backoff_s=0.5")
    windows = []  # (step killed at, version it serves again at)
    replicas = []  # the index of the replica started again, each time
    try:
        at = 20
        for _ in range(2):  # a replica, then one of the two (possibly the restarted one)
            run.wait_step(at)
            os.kill(run.actor_pids("EngineActor")[0], signal.SIGKILL)
            # "... died ...; starting it again (k/3) ...", then "serves again at version v". On a loaded
            # machine a start may fail and be tried again first (each try a restart of the replica's
            # three): read the replica's lines until it serves, whatever came between.
            back = run.wait_line("asyncrl: engine[")
            while "serves again at version" not in back:
                assert "left out" not in back, run.output[-3000:]
                back = run.wait_line("asyncrl: engine[")
            print(back.strip())
            replicas.append(int(back.split("engine[")[1].split("]")[0]))
            windows.append((at, int(back.split("at version ")[1].split(",")[0])))
            at = windows[-1][1] + 20
            assert at < steps, back
        assert run.finish() == 0, run.output[-3000:]
    finally:
        run.kill_all()
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    restarts = [e["value"] for e in events if e["name"] == "fault/engine_restarts"]
    assert max(restarts) == 2, restarts  # replicas that joined again: one per kill, however many tries each took
    # It serves: the restarted replica's own counters (its actor counts from 0; the Rollouter's
    # reports read replica i's current actor, and a report at version >= the one it serves again
    # at comes after the Rollouter took it) grow while the run goes on: it is sent requests and
    # generates tokens. (The "serves again" line is printed before any request reaches it.)
    ends = [w[0] for w in windows[1:]] + [steps]
    for i, (_, back_at), until in zip(replicas, windows, ends):
        for counter in ("requests", "tokens_generated"):
            seen = [e["value"] for e in events if e["name"] == f"engine/{i}/{counter}" and back_at <= e["version"] < until]
            assert len(seen) >= 2 and seen[-1] > seen[0], (i, counter, back_at, seen[:5], seen[-5:])
    check_exactly_once(run_dir, steps)
    rate = {m["step"]: m["tokens_per_s"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}

    def mean(lo, hi):
        xs = [rate[s] for s in range(lo, hi) if s in rate]
        return sum(xs) / len(xs)

    (k1, b1), (k2, b2) = windows
    print(f"tokens/s: two replicas, steps 5-{k1}: {mean(5, k1):.0f}; one, steps {k1 + 1}-{b1}: {mean(k1 + 1, b1 + 1):.0f}; "
          f"two again, steps {b1 + 1}-{k2}: {mean(b1 + 1, k2):.0f}; one, steps {k2 + 1}-{b2}: {mean(k2 + 1, b2 + 1):.0f}; "
          f"two again, steps {b2 + 1}-{steps}: {mean(b2 + 1, steps + 1):.0f}")
