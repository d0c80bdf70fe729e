"""Whole-run crashes and resume through ``python -m asyncrl.launch``: exactly-once across them.

One run is interrupted five ways, each at a seeded random step, and resumed each time:
an engine actor killed (two engines: the run goes on without it), the Rollouter actor killed
(the run stops with a checkpoint and a clear error), a trainer rank killed (stops; the last
checkpoint stays the resume point), Ctrl-C to the process group (clean stop, exit 0), and the
launcher itself killed with SIGKILL (its local Ray cluster dies with it). Then:

- ``samples.jsonl`` names no id twice and exactly the final checkpoint's committed set; every
  feed index below the final ``next_index`` is trained, dropped with a reason, or pending in
  the final checkpoint (in flight or sent and not acked);
- on-policy (staleness 0, a sync every step) the interrupted run ends with the same parameters
  (within 1e-6) and the same ``samples.jsonl`` as an uninterrupted run with the same seed.

Actors are found among the launcher's own descendants and killed by pid (`launching.Launch`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch

from asyncrl.hang import WARMUP_STEPS
from asyncrl.models.tiny import build_tiny_model
from asyncrl.types import CommittedSet, parse_sample_id
from tests.integration.launching import Launch

STEPS, GROUPS = 14, 2
COMMON = ["--steps", str(STEPS), "--n", "2", "--groups-per-step", str(GROUPS), "--max-tokens", "3",
          "--lr", "1e-3", "--sync-every", "1", "--staleness-threshold", "0", "--engines", "2", "--seed", "3",
          "trainer.checkpoint_every=2", "--max-restarts", "0"]  # each death stops the run (restarts: below)


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = run_dir / "checkpoints"
    out = run_dir / "final.pt"
    dcp_to_torch_save(ckpt / (ckpt / "latest").read_text().strip(), out)
    return torch.load(out, weights_only=False)["model"]


def _sidecar(run_dir: Path) -> dict:
    ckpt = run_dir / "checkpoints"
    return json.loads((ckpt / (ckpt / "latest").read_text().strip() / "trainer_state.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_process_killed_then_resumed_trains_each_sample_once_and_matches_an_uninterrupted_run(tmp_path):
    rng = random.Random(14)
    model = build_tiny_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    resume = ["--resume", str(run_dir)]
    runs: list[Launch] = []

    def later(run: Launch) -> int:
        """A seeded random step 1-2 steps after the one ``run`` restored."""
        return run.restored_step() + rng.randint(1, 2)

    try:
        # 1. An engine dies: the run goes on with the other one. Then the Rollouter dies: the run
        #    stops, with a checkpoint of what it trained and an error naming the Rollouter.
        run = Launch("--model", str(model), "--run-dir", str(run_dir), *COMMON)
        runs.append(run)
        run.wait_step(rng.randint(1, 2))
        os.kill(run.actor_pids("EngineActor")[0], signal.SIGKILL)
        at = rng.randint(4, 5)
        run.wait_step(at)
        assert "died; going on with 1" in run.output, run.output[-3000:]
        os.kill(run.actor_pids("RolloutWorker")[0], signal.SIGKILL)
        assert run.finish() == 1, run.output[-3000:]
        assert "stopping on" in run.output and "--resume" in run.output, run.output[-3000:]
        assert _sidecar(run_dir)["step"] >= at

        # 2. A trainer rank dies: the run stops; the last checkpoint stays the resume point.
        run = Launch(*resume)
        runs.append(run)
        run.wait_step(later(run))
        before = _sidecar(run_dir)["step"]
        os.kill(run.actor_pids("TrainerWorker")[0], signal.SIGKILL)
        assert run.finish() == 1, run.output[-3000:]
        assert "stopping on" in run.output, run.output[-3000:]
        assert _sidecar(run_dir)["step"] >= before

        # 3. Ctrl-C, as a terminal sends it (to the whole process group): clean stop, exit 0.
        run = Launch(*resume)
        runs.append(run)
        run.wait_step(step := later(run))
        os.killpg(run.proc.pid, signal.SIGINT)
        assert run.finish() == 0, run.output[-3000:]
        stopped = _sidecar(run_dir)["step"]
        assert "stopped cleanly at step" in run.output and stopped >= step

        # 4. The launcher killed with SIGKILL.
        run = Launch(*resume)
        runs.append(run)
        restored = run.restored_step()
        assert restored == stopped
        run.wait_step(restored + rng.randint(1, 2))
        run.kill_all()  # its Ray processes notice and exit; any still there after 60 s are killed by pid

        # 5. Resume to the end.
        run = Launch(*resume)
        runs.append(run)
        assert run.finish() == 0, run.output[-3000:]

        # The reference: the same run, never interrupted.
        ref_dir = tmp_path / "reference"
        ref = Launch("--model", str(model), "--run-dir", str(ref_dir), *COMMON)
        runs.append(ref)
        assert ref.finish() == 0, ref.output[-3000:]
    finally:
        for r in runs:
            r.kill_all()

    _check_exactly_once(run_dir)

    # On-policy, every id is generated from the same weights with the same seeds, interrupted or not.
    assert (run_dir / "samples.jsonl").read_text() == (ref_dir / "samples.jsonl").read_text()
    got, want = _final_params(run_dir), _final_params(ref_dir)
    assert got.keys() == want.keys()
    for k in want:
        assert (got[k] - want[k]).abs().max().item() <= 1e-6, k


def _check_exactly_once(run_dir: Path, steps: int = STEPS, groups: int = GROUPS) -> None:
    """samples.jsonl names each id once, exactly the final checkpoint's committed set, every step
    trained; every feed index below ``next_index`` trained, dropped with a reason, or pending."""
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    ids = [r["sample_id"] for r in records]
    assert len(ids) == len(set(ids)), "a sample_id is listed twice"
    state = _sidecar(run_dir)
    assert state["step"] == steps
    committed = CommittedSet.from_json(state["committed"])
    assert committed == set(ids)
    assert all(r["reason"] for r in records if r["status"] == "dropped")
    trained = [r for r in records if r["status"] == "trained"]
    assert sorted(r["step"] for r in trained) == sorted(s for s in range(1, steps + 1) for _ in range(groups))
    feed = state["rollouter_state"]
    done = {parse_sample_id(sid)[1] for sid in ids}
    pending = {parse_sample_id(sid)[1] for sid in feed["in_flight"] + feed["unacked"]}
    assert set(range(feed["next_index"])) <= done | pending  # trained, dropped, or still pending
    assert max(done | pending) < feed["next_index"]


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
    _check_exactly_once(run_dir)


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
    _check_exactly_once(run_dir, steps, groups)


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
            back = run.wait_line("asyncrl: engine[")  # "... died ...; starting it again (k/3) ..."
            if "serves again" not in back:
                back = run.wait_line("asyncrl: engine[")
            assert "serves again at version" in back, run.output[-3000:]
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
    assert max(restarts) == 2, restarts
    # It serves: the restarted replica's own counters (its actor counts from 0; the Rollouter's
    # reports read replica i's current actor, and a report at version >= the one it serves again
    # at comes after the Rollouter took it) grow while the run goes on: it is sent requests and
    # generates tokens. (The "serves again" line is printed before any request reaches it.)
    ends = [w[0] for w in windows[1:]] + [steps]
    for i, (_, back_at), until in zip(replicas, windows, ends):
        for counter in ("requests", "tokens_generated"):
            seen = [e["value"] for e in events if e["name"] == f"engine/{i}/{counter}" and back_at <= e["version"] < until]
            assert len(seen) >= 2 and seen[-1] > seen[0], (i, counter, back_at, seen[:5], seen[-5:])
    _check_exactly_once(run_dir, steps)
    rate = {m["step"]: m["tokens_per_s"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}

    def mean(lo, hi):
        xs = [rate[s] for s in range(lo, hi) if s in rate]
        return sum(xs) / len(xs)

    (k1, b1), (k2, b2) = windows
    print(f"tokens/s: two replicas, steps 5-{k1}: {mean(5, k1):.0f}; one, steps {k1 + 1}-{b1}: {mean(k1 + 1, b1 + 1):.0f}; "
          f"two again, steps {b1 + 1}-{k2}: {mean(b1 + 1, k2):.0f}; one, steps {k2 + 1}-{b2}: {mean(k2 + 1, b2 + 1):.0f}; "
          f"two again, steps {b2 + 1}-{steps}: {mean(b2 + 1, steps + 1):.0f}")
