"""``scripts/bench_overlap.py`` runs its four parts on a small setting and reports figures that
agree with each other (no timing targets: the machine is shared)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_bench_overlap_reports_consistent_figures_of_its_four_parts():
    # One prompt in flight per response slot of a step: every step of (a) generates on its own, so takes time.
    out = subprocess.run([sys.executable, "scripts/bench_overlap.py", "--steps", "4", "--from-step", "2",
                          "--alone-steps", "3", "--warmup", "1", "--groups-per-step", "2", "--n", "2",
                          "--max-tokens", "8", "rollout.max_concurrent=2", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    lines = out.stdout.strip().splitlines()
    r = json.loads(lines[-1])
    assert {"gen_s", "train_s", "async_s", "overlap", "vs_serial", "gen_tok_s", "response_len_mean", "async_tok_s",
            "update_s", "sync_s", "trainer_wait", "engine_idle", "bound", "bound_counts", "steps", "load_1m",
            "gen_shared_s", "train_shared_s", "update_shared_s", "shared_s", "overlap_vs_shared"} <= set(r)
    assert all(r[k] > 0 for k in ("gen_s", "train_s", "async_s", "gen_tok_s", "async_tok_s", "update_s", "sync_s"))
    # Values are rounded to 4 decimals before the JSON line.
    assert r["overlap"] == pytest.approx(max(r["gen_s"], r["train_s"]) / r["async_s"], rel=2e-3, abs=2e-4)
    assert r["vs_serial"] == pytest.approx((r["gen_s"] + r["train_s"]) / r["async_s"], rel=2e-3, abs=2e-4)
    # (d): both loops at once; the slower of them bounds what (c) could do.
    assert r["gen_shared_s"] > 0 and r["update_shared_s"] <= r["train_shared_s"]
    assert r["shared_s"] == max(r["gen_shared_s"], r["train_shared_s"])
    assert r["overlap_vs_shared"] == pytest.approx(r["shared_s"] / r["async_s"], rel=2e-3, abs=2e-4)
    assert r["update_s"] <= r["train_s"] and r["sync_s"] <= r["train_s"]  # parts of each of (b)'s steps
    assert 1 <= r["response_len_mean"] <= 8 and 0 <= r["trainer_wait"] <= 1 and 0 <= r["engine_idle"] <= 1
    # (c)'s steady state is steps 2..4, each with its bound side.
    assert r["steps"] == 3 and sum(r["bound_counts"].values()) == 3
    assert set(r["bound_counts"]) <= {"engine", "trainer", "both", "handoff"} and r["bound"] in r["bound_counts"]
    text = "\n".join(lines)
    for part in ("(a) generation alone", "(b) training alone", "(c) async pipeline", "(d) both at once"):
        assert part in text
