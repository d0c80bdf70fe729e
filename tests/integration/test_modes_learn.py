"""Learning: ``python -m asyncrl.launch --mode sync`` (on-policy lockstep) raises the reward on the
built-in addition task as well as the fully async mode does in the same number of steps
(a reduced run of ``scripts/learn_sync.py``; fixed seeds)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from learn_sync import learn, window_means  # noqa: E402

STEPS, PROMPTS, N, WINDOW = 24, 16, 8, 5
LR = 1e-3  # the demo's rate: 3e-3 collapses the head-32 demo model to reward 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sync_mode_learns_as_well_as_async(tmp_path):
    runs = {mode: learn(mode, STEPS, PROMPTS, N, LR, 0, tmp_path / mode) for mode in ("sync", "async")}
    sync, async_ = runs["sync"], runs["async"]
    assert [m["step"] for m in sync] == list(range(1, STEPS + 1)) == [m["step"] for m in async_]
    # Lockstep: every step trained on groups of the weights it had, and synced after itself.
    assert all(m["staleness_max"] == 0 for m in sync)
    assert [m["version"] for m in sync] == list(range(1, STEPS + 1))
    assert max(m["staleness_max"] for m in async_) >= 1  # async really ran ahead
    (s_first, s_last), (a_first, a_last) = window_means(sync, WINDOW), window_means(async_, WINDOW)
    print(f"sync {s_first:.3f} -> {s_last:.3f}; async {a_first:.3f} -> {a_last:.3f}")
    assert s_last >= s_first + 0.1, (s_first, s_last)
    assert a_last >= a_first + 0.1, (a_first, a_last)
    assert s_last >= a_last - 0.1, (s_last, a_last)
