"""Whole-run crashes and resume through ``python -m asyncrl.launch``: exactly-once across them.

One run is interrupted four ways, each at a seeded random step, and resumed each time:
an engine actor killed (two engines: the run goes on without it), the Rollouter actor killed
(the run stops with a checkpoint and a clear error), Ctrl-C to the process group (clean stop,
exit 0), and the launcher itself killed with SIGKILL (its local Ray cluster dies with it). (A
trainer rank killed: test_restarts.py's seeded schedule of kills, restarting from the last
checkpoint.) Then:

- ``samples.jsonl`` names no id twice and exactly the final checkpoint's committed set; every
  feed index below the final ``next_index`` is trained, dropped with a reason, or pending in
  the final checkpoint (in flight or sent and not acked);
- on-policy (staleness 0, a sync every step) the interrupted run ends with the same parameters
  (within 1e-6) and the same ``samples.jsonl`` as an uninterrupted run with the same seed.

The first test runs with dynamic sampling on (``rollout.group_filter``, a user filter dropping a
third of the groups): a dropped group is one more drop the audit must list once, and the
trained groups, their steps and the parameters still match the uninterrupted run.

Actors are found among the launcher's own descendants and killed by pid (`launching.Launch`).
"""

from __future__ import annotations

import json
import os
import random
import signal

import pytest

from asyncrl.models.tiny import build_tiny_model
from asyncrl.types import parse_sample_id
from tests.integration.launching import COMMON, Launch, check_exactly_once, final_params, sidecar

FILTERS = """
from asyncrl.types import parse_sample_id

def drop_a_third(view):
    return parse_sample_id(view.sample_id)[1] % 3 != 1
"""


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_process_killed_then_resumed_trains_each_sample_once_and_matches_an_uninterrupted_run(tmp_path,
                                                                                                  monkeypatch):
    rng = random.Random(14)
    model = build_tiny_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    resume = ["--resume", str(run_dir)]
    (tmp_path / "resume_filters.py").write_text(FILTERS)  # imported by the launcher and the Rollouter actor
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    filtered = ["rollout.group_filter=resume_filters:drop_a_third"]  # kept in the run's config.yaml for resumes
    runs: list[Launch] = []

    def later(run: Launch) -> int:
        """A seeded random step 1-2 steps after the one ``run`` restored."""
        return run.restored_step() + rng.randint(1, 2)

    try:
        # 1. An engine dies: the run goes on with the other one. Then the Rollouter dies: the run
        #    stops, with a checkpoint of what it trained and an error naming the Rollouter.
        run = Launch("--model", str(model), "--run-dir", str(run_dir), *COMMON, *filtered)
        runs.append(run)
        run.wait_step(rng.randint(1, 2))
        os.kill(run.actor_pids("EngineActor")[0], signal.SIGKILL)
        at = rng.randint(4, 5)
        run.wait_step(at)
        assert "died; going on with 1" in run.output, run.output[-3000:]
        os.kill(run.actor_pids("RolloutWorker")[0], signal.SIGKILL)
        assert run.finish() == 1, run.output[-3000:]
        assert "stopping on" in run.output and "--resume" in run.output, run.output[-3000:]
        assert sidecar(run_dir)["step"] >= at

        # 2. Ctrl-C, as a terminal sends it (to the whole process group): clean stop, exit 0.
        run = Launch(*resume)
        runs.append(run)
        run.wait_step(step := later(run))
        os.killpg(run.proc.pid, signal.SIGINT)
        assert run.finish() == 0, run.output[-3000:]
        stopped = sidecar(run_dir)["step"]
        assert "stopped cleanly at step" in run.output and stopped >= step

        # 3. The launcher killed with SIGKILL.
        run = Launch(*resume)
        runs.append(run)
        restored = run.restored_step()
        assert restored == stopped
        run.wait_step(restored + rng.randint(1, 2))
        run.kill_all()  # its Ray processes notice and exit; any still there after 60 s are killed by pid

        # 4. Resume to the end.
        run = Launch(*resume)
        runs.append(run)
        assert run.finish() == 0, run.output[-3000:]

        # The reference: the same run, never interrupted.
        ref_dir = tmp_path / "reference"
        ref = Launch("--model", str(model), "--run-dir", str(ref_dir), *COMMON, *filtered)
        runs.append(ref)
        assert ref.finish() == 0, ref.output[-3000:]
    finally:
        for r in runs:
            r.kill_all()

    check_exactly_once(run_dir)

    # On-policy, every id is generated from the same weights with the same seeds, interrupted or not,
    # and the filter keeps the same ones: the same groups train in the same steps. (Which step's
    # collection received a dropped group, and whether the last dropped ones arrived before the
    # end, depends on timing.)
    got, want = ([json.loads(line) for line in (d / "samples.jsonl").read_text().splitlines()] for d in (run_dir, ref_dir))
    assert [r for r in got if r["status"] == "trained"] == [r for r in want if r["status"] == "trained"]
    dropped = [r for r in got if r["status"] == "dropped"]
    assert dropped and all(r["reason"] == "filtered" and parse_sample_id(r["sample_id"])[1] % 3 == 1 for r in dropped)
    assert all(parse_sample_id(r["sample_id"])[1] % 3 != 1 for r in got if r["status"] == "trained")
    got, want = final_params(run_dir), final_params(ref_dir)
    assert got.keys() == want.keys()
    for k in want:
        assert (got[k] - want[k]).abs().max().item() <= 1e-6, k
