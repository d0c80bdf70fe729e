"""A crash while a function agent's episode is in flight, then a resume (docs/endpoint.md, "Weight
syncs, partial rollout, resume"): the process is killed with SIGKILL right after a checkpoint whose
Rollouter snapshot lists the held episodes' group in flight; the restarted process restores from it
as the launcher does (`endpoint_resume_child.py` runs both). The episode runs again from its start:
its agent is called again with the same ``episode_key`` and a new URL and key; the old ones are
refused; its trained tokens are all sampled after the resume, none from the interrupted attempt; its
side effect, keyed by the episode, is not made twice; every group is trained exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.integration.launching import ROOT

CHILD = "tests.integration.endpoint_resume_child"
GATED = "sample_0_3"  # the feed's fourth prompt, q3: its episodes are held in attempt 1
KEYS = {f"{GATED}/0", f"{GATED}/1"}


def attempt(run_dir, model, n: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "EP_RESUME_DIR": str(run_dir), "EP_RESUME_ATTEMPT": str(n), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", CHILD, str(model), str(n)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240, check=False)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_crash_mid_episode_runs_it_again_from_its_start_and_trains_every_group_once(tmp_path):
    from asyncrl.models.tiny_chat import build_chat_model
    from asyncrl.trainer import checkpoint
    from asyncrl.types import CommittedSet, parse_sample_id

    model = build_chat_model(tmp_path / "model")
    run = tmp_path / "run"
    run.mkdir()
    first = attempt(run, model, 1)
    assert first.returncode == -signal.SIGKILL, (first.stdout + first.stderr)[-3000:]
    _, state = checkpoint.latest(run / "checkpoints")
    saved, done = state.rollouter_state, CommittedSet.from_json(state.committed)
    # The checkpoint the crash followed: the held group in flight, nothing of its conversation saved.
    assert GATED in saved["in_flight"] and GATED not in done and saved["partials"] == {}, saved
    second = attempt(run, model, 2)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]

    log = lines(run / "agent.jsonl")
    starts = {a: [r for r in log if r["event"] == "start" and r["attempt"] == a] for a in (1, 2)}
    calls = {a: [r["key"] for r in log if r["event"] == "call" and r["attempt"] == a] for a in (1, 2)}
    # Run again from its start: the agent is called again for each held episode, with the same key,
    # a new URL and a new secret; attempt 1 made one call each, attempt 2 both calls.
    old = {r["key"]: r for r in starts[1] if r["key"] in KEYS}
    new = {r["key"]: r for r in starts[2] if r["key"] in KEYS}
    assert old.keys() == new.keys() == KEYS
    for key in KEYS:
        assert new[key]["base_url"] != old[key]["base_url"] and new[key]["api_key"] != old[key]["api_key"]
        assert calls[1].count(key) == 1 and calls[2].count(key) == 2
    # Every group in flight at the checkpoint ran again; no group the checkpoint had trained did.
    in_flight = set(saved["in_flight"])
    again = {r["key"].rsplit("/", 1)[0] for r in starts[2]}
    assert in_flight <= again and not {sid for sid in again if sid in done}, (in_flight, again)
    # The old URL and secret are refused: nothing listens there any more (or, on a reused port, no
    # such episode), the old path on the new server is unknown (404), the old key opens nothing (401).
    probes = [r for r in log if r["event"] == "probe"]
    assert sorted(r["key"] for r in probes) == sorted(KEYS)
    for r in probes:
        assert r["old_url"] in ("refused", 404) and r["old_path_here"] == 404 and r["old_key_here"] == 401, r
    # The side effect, keyed by episode_key and call: made once, before the crash; the repeat found it.
    ledger = [r["key"] for r in lines(run / "ledger.jsonl")]
    assert len(ledger) == len(set(ledger)) and {f"{k}/c0" for k in KEYS} <= set(ledger)
    assert [r["now"] for r in log if r["event"] == "booked" and r["key"] in KEYS] == [True, True, False, False]

    # The held group as sent after the resume: both episodes' whole conversations from attempt 2 (its
    # first message), every sampled token of a version at or after the restored one (none from before).
    sent = lines(run / "sent.jsonl")
    (gated,) = [g for g in sent if g["sample_id"] == GATED]
    assert gated["attempt"] == 2 and gated["status"] == "ok" and len(gated["trajectories"]) == 2
    for t in gated["trajectories"]:
        assert "q3 attempt 2" in t["text"] and "attempt 1" not in t["text"] and t["turns"] == 2, t
        assert t["sampled_versions"] and min(t["sampled_versions"]) >= state.version, (t, state.version)
    # Stream side: attempt 2 sent each group once, none the checkpoint had trained.
    resent = [g["sample_id"] for g in sent if g["attempt"] == 2]
    assert len(resent) == len(set(resent)) and not [sid for sid in resent if sid in done]
    # Trainer side: every group admitted before the crash trained exactly once across it.
    trained = [r["sample_id"] for r in lines(run / "samples.jsonl")]
    assert len(trained) == len(set(trained)), trained
    indices = {parse_sample_id(sid)[1] for sid in trained}
    assert set(range(saved["next_index"])) <= indices, (sorted(indices), saved["next_index"])
    assert [r["sample_id"] for r in lines(run / "transcripts.jsonl")].count(GATED) == 1
