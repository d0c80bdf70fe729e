"""``scripts/bench_e2e.py``: its ratios are the median of runs made side by side with their spread, a
mode learns on a seed only when its end reward beats its start, and the script runs end to end
through the launcher (tiny: no timing targets, the machine is shared)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_e2e  # noqa: E402


def _run(seed, time_s, start, end, bound):
    return {"seed": seed, "time_s": time_s, "reward_start": start, "reward_end": end, "bound": bound}


def test_speedup_is_the_median_of_paired_ratios_and_learning_is_judged_per_seed():
    # Two seeds x two repeats, listed in the same (seed, repeat) order for both modes.
    sync = [_run(0, 10.0, 0.2, 0.3, {"handoff": 3}), _run(0, 12.0, 0.2, 0.4, {"handoff": 3}),
            _run(1, 30.0, 0.3, 0.2, {"handoff": 2, "engine": 1}), _run(1, 9.0, 0.3, 0.3, {"handoff": 3})]
    async_ = [_run(0, 5.0, 0.1, 0.3, {"both": 3}), _run(0, 8.0, 0.1, 0.3, {"engine": 3}),
              _run(1, 10.0, 0.2, 0.4, {"trainer": 3}), _run(1, 9.0, 0.2, 0.3, {"both": 3})]
    out = bench_e2e.summarize({"sync": sync, "async": async_})
    # Ratios per pair: 2.0, 1.5, 3.0, 1.0. The ratio of the medians (10.5 / 8.5) would be 1.24.
    assert out["speedup_async"] == pytest.approx(1.75)
    assert (out["speedup_async_min"], out["speedup_async_max"]) == (pytest.approx(1.0), pytest.approx(3.0))
    assert (out["sync_s"], out["async_s"]) == (pytest.approx(11.0), pytest.approx(8.5))
    # Seed 1 of sync: start 0.3, end 0.25 over its repeats: it did not learn there.
    assert out["learned_sync"] == [True, False] and out["learned_async"] == [True, True]
    assert out["reward_sync"] == pytest.approx((0.35 + 0.25) / 2)
    assert out["reward_async"] == pytest.approx((0.3 + 0.35) / 2)
    assert out["reward_gap_async"] == pytest.approx(0.025)
    assert out["bound_sync"] == {"handoff": 11, "engine": 1}
    assert out["bound_async"] == {"both": 6, "engine": 3, "trainer": 3}
    assert "speedup_sync_partial" not in out and "partial_vs_async" not in out


def test_runs_missing_a_partner_are_refused():
    with pytest.raises(ValueError):
        bench_e2e.summarize({"sync": [_run(0, 1.0, 0, 0, {})] * 2, "async": [_run(0, 1.0, 0, 0, {})]})


def test_windows_must_not_overlap():
    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--steps", "6", "--window", "5"])


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_bench_e2e_runs_sync_and_async_through_the_launcher(capsys):
    out = bench_e2e.main(["--steps", "2", "--window", "1", "--seeds", "0", "--repeats", "1",
                          "--groups-per-step", "2", "--n", "2", "--json"])
    printed = capsys.readouterr().out
    assert json.loads(printed.strip().splitlines()[-1]) == json.loads(json.dumps(bench_e2e._rounded(out)))
    assert out["sync_s"] > 0 and out["async_s"] > 0
    # One pair: the median, min and max are its own ratio.
    assert out["speedup_async"] == out["speedup_async_min"] == out["speedup_async_max"]
    assert out["speedup_async"] == pytest.approx(out["sync_s"] / out["async_s"])
    assert len(out["learned_sync"]) == len(out["learned_async"]) == 1
    # Steps 2..3 of each run are judged (step 1 is the warm-up), each by one side.
    assert sum(out["bound_sync"].values()) == sum(out["bound_async"].values()) == 2
    assert set(out["bound_sync"]) | set(out["bound_async"]) <= {"engine", "trainer", "both", "handoff"}
    assert 0 <= out["reward_sync"] <= 1 and 0 <= out["reward_async"] <= 1
