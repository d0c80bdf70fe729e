"""A process that does not come up in time is named: the launcher's start-up timeout writes every
process's stacks to ``<run_dir>/hang-<time>.txt`` and its error says where they wait.

CI once saw a trainer rank not up within ``rank_start_timeout_s`` with nothing to say where it
waited; a deadline too short for a rank to load makes the same timeout on demand.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_ranks_not_up_in_time_are_named_with_their_stacks(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.launch", "--model", str(model), "--steps", "2", "--run-dir", str(run_dir),
         "trainer.rank_start_timeout_s=0.5", "max_restarts=0"],
        capture_output=True, text=True, cwd=ROOT, timeout=200, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "trainer ranks not up within rank_start_timeout_s=0.5" in out, out[-3000:]
    (dump,) = run_dir.glob("hang-*.txt")
    assert f"stacks in {dump}" in out, out[-3000:]
    text = dump.read_text()
    assert text.startswith("start-up: trainer ranks not up within rank_start_timeout_s=0.5")
    assert ", the launcher)" in text  # the launcher's own stacks, then each process's that answered
    # One line names the fault (no traceback: the fault is the run's, not the code's).
    assert "asyncrl: the run failed (max_restarts=0): TimeoutError: trainer ranks not up" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
