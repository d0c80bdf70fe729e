"""``python -m asyncrl.launch`` end to end: engines, Rollouter, ZeroMQ stream, Trainer, weight sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from asyncrl.metrics.names import is_known
from asyncrl.metrics.sinks.jsonl import read_events
from asyncrl.models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_help_is_instant_and_lists_the_flags():
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0
    for flag in ("--rollouter-gpus", "--trainer-gpus", "--model", "--dataset", "--reward", "--steps"):
        assert flag in out.stdout
    probe = subprocess.run([sys.executable, "-c", "import sys, asyncrl.launch as l; l.parse_args(['--steps','2']);"
                            "print('torch' in sys.modules, 'ray' in sys.modules)"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert probe.stdout.split() == ["False", "False"], probe.stderr


def test_bad_flags_name_the_flag():
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch", "--rollouter-gpus", "2"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "--trainer-gpus" in out.stderr
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch", "--steps", "0"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "steps (--steps) must be >= 1" in out.stderr


@pytest.mark.timeout(400)
def test_pipeline_runs_async_steps_with_weight_syncs(tmp_path, run_launch):
    from asyncrl.tasks import arithmetic

    model = build_tiny_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(r) + "\n" for r in arithmetic.generate_dataset(5, seed=99)))
    out = run_launch("--model", model, "--steps", "4", "--n", "4", "--groups-per-step", "3", "--sync-every", "2",
                     "--max-tokens", "4", "--lr", "1e-3", "--run-dir", run_dir, "--val-dataset", val,
                     "--reward", "asyncrl.tasks.arithmetic:reward", "data.val_every=2", timeout=360)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # One weight sync every 2 steps: the version the trainer reports follows it.
    assert [r["version"] for r in rows] == [0, 1, 1, 2]
    assert all(r["groups"] == 3 for r in rows)
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    # The validation file is scored every 2 steps, under val/.
    assert [r.get("val/samples") for r in rows] == [None, 5.0, None, 5.0]
    assert all(0.0 <= r["val/reward_mean"] <= 1.0 for r in rows[1::2])
    assert "step   4/4" in out and "mean reward" in out
    # The metric stream: every process reported into events.jsonl, under names the README lists.
    events = read_events(run_dir / "events.jsonl")
    assert [(e.step, e.version, e.value) for e in events if e.name == "train/groups"] == \
        [(1, 0, 3), (2, 1, 3), (3, 1, 3), (4, 2, 3)]
    assert [e.step for e in events if e.name == "timing_s/param_sync"] == [2, 4]
    assert [e.step for e in events if e.name == "val/samples"] == [2, 4]
    names = {e.name for e in events}
    assert {"fully_async/rollouter/idle_ratio", "engine/0/running", "stream/credit",
            "fully_async/trainer/idle_ratio", "staleness/hist/0", "response_length/p90"} <= names
    assert all(is_known(n) for n in names), sorted(n for n in names if not is_known(n))
    # The resolved config and the per-step log are in the run directory.
    from asyncrl.config import load_config

    cfg, _ = load_config([str(run_dir / "config.yaml")], [])
    assert (cfg.steps, cfg.rollout.n, cfg.trainer.trigger_parameter_sync_step, cfg.model.path) == (4, 4, 2, str(model))
    log = (run_dir / "train.log").read_text().splitlines()
    assert len(log) == 4 and log[-1].startswith("step   4/4")
    ckpts = sorted((run_dir / "checkpoints").iterdir())
    assert ckpts
    sidecars = [json.loads(p.read_text()) for p in (run_dir / "checkpoints").rglob("*.json")]
    feed = [s["rollouter_state"] for s in sidecars if s.get("rollouter_state")]
    assert feed and all(f["next_index"] >= 12 for f in feed), sidecars


# Two runs, each with its own deadline inside the test's: one that runs long says where it was (its
# output's tail; CI once ran past a single 400 s deadline that left nothing to read).
@pytest.mark.timeout(640)
def test_sync_partial_rollout_from_the_launcher_ends_each_step_at_its_groups_and_resumes_the_long_tail(
        tmp_path, run_launch):
    model = build_tiny_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    # --mode sync --partial-rollout true: each round keeps 8 prompts in flight (twice the step's
    # 4) and ends once the step has 4 complete groups; the long tail is truncated and goes on first.
    out = run_launch("--model", model, "--steps", "6", "--n", "4", "--groups-per-step", "4", "--long-tail", "16",
                     "--mode", "sync", "--partial-rollout", "true", "--lr", "1e-3", "--run-dir", run_dir,
                     timeout=300)
    assert "mode sync, partial rollout" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(r["groups"] == 4 for r in rows)
    assert [r["version"] for r in rows] == list(range(1, 7))
    # Rounds ended at the step's groups and their long tail was stopped, then resumed on newer weights.
    assert sum(r["fully_async/partial/truncated"] for r in rows) >= 1, rows
    assert sum(r["fully_async/partial/total_partial_num"] for r in rows) >= 1
    assert max(r["fully_async/partial/max_partial_span"] for r in rows) >= 1
    # Every trained group was complete, and trained once.
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    ids = [r["sample_id"] for r in records if r["status"] == "trained"]
    assert len(ids) == 24 == len(set(ids))
    assert all(r.get("dropped_incomplete", 0) == 0 for r in rows)

    # The final checkpoint keeps the partial buffer (the last round's long tail, truncated when
    # step 6 had its groups); a resume continues those responses from their parts. The sync after
    # step 6 releases them before the checkpoint, so on a loaded machine every one may have been
    # resumed and finished before its snapshot (seen once, in a full-suite run at load 18): then their
    # groups are generated again whole, and only the exactly-once checks below apply. Which path ran
    # is reported (a warning in the summary when the saved parts were not used); continuing each
    # response from its saved parts is asserted every time, deterministically, by tests/unit/
    # test_partial_rollout.py's test_a_checkpoint_keeps_the_partial_buffer_and_a_resume_continues_...
    ckpt = run_dir / "checkpoints"
    feed = json.loads((ckpt / (ckpt / "latest").read_text().strip() / "trainer_state.json").read_text())["rollouter_state"]
    saved = sum(len(responses) for responses in feed["partials"].values())
    assert saved > 0 or feed["in_flight"], feed
    if not saved:
        warnings.warn(f"the resume from saved parts did not run this time: the checkpoint held no truncated "
                      f"responses, {len(feed['in_flight'])} groups in flight to generate again (the path is "
                      "covered by test_partial_rollout.py::test_a_checkpoint_keeps_the_partial_buffer_and_a_resume_"
                      "continues_each_response_from_its_parts)", stacklevel=1)
    out = run_launch("--resume", run_dir, "--steps", "8", timeout=300)
    if saved:
        assert f"{saved} truncated responses go on from their saved parts" in out, out[-3000:]
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    ids = [r["sample_id"] for r in records if r["status"] == "trained"]
    assert len(ids) == 32 == len(set(ids))
    # Each saved response's group was trained after the resume, or (a long one, truncated again)
    # is still in flight, or sent and not yet trained, in the newest checkpoint: nothing was lost.
    latest = json.loads((ckpt / (ckpt / "latest").read_text().strip() / "trainer_state.json").read_text())
    still = latest["rollouter_state"]
    for sid in set(feed["partials"]) - set(ids):
        assert sid in still["in_flight"] or sid in still["unacked"], (sid, still)
