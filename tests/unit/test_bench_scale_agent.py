"""``scripts/bench_scale.py --agent`` (many conversations at once through one Rollouter), small:
every admitted conversation ends in exactly one sent group with all its turns, each turn one
engine request of its session, and the JSON last line carries the figures docs/scale.md quotes."""

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_scale  # noqa: E402
import bench_scale_agent  # noqa: E402

KEYS = {"agent_conversations", "loop_lag_p99_ms", "turn_req_s", "lost", "duplicated", "tool_calls_per_s", "mean_turns",
        "bad_turns", "failed", "turn_requests", "prefill_tokens_per_turn", "session_tokens_reused_per_turn"}


@pytest.mark.timeout(120)
def test_fifty_conversations_end_in_one_group_each_with_every_turn(capsys):
    result = bench_scale.main(["--agent", "--json", "--agent-repeats", "2", "--agent-conversations", "48", "--agent-rounds", "2",
                               "--agent-replicas", "4", "--tool-median-s", "0.005", "--tool-p99-s", "0.02"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == json.loads(json.dumps(result))
    assert KEYS <= result.keys()
    assert result["agent_conversations"] == 48 and result["conversations_admitted"] == 96
    assert result["conversations_sent"] == 96
    assert result["lost"] == result["duplicated"] == result["bad_turns"] == result["failed"] == 0
    assert result["mean_turns"] == 4.0
    assert result["turn_requests"] == 96 * 4  # each turn one engine request, none repeated
    assert result["turn_req_s"] > 0 and result["tool_calls_per_s"] > 0
    for run in result["runs"]:  # the lag figures are the window's own ticks (none: the whole run's stand in)
        assert run["loop_lag_ticks"] >= 1, run
        # uvloop may end a 10 ms sleep early (whole-ms timers): that wake counts 0, so the median may be 0
        assert 0 <= run["loop_lag_p50_ms"] <= run["loop_lag_p99_ms"] <= run["loop_lag_max_ms"] <= run["run_lag_max_ms"]
        assert run["run_lag_max_ms"] > 0, run  # some wake-up came late under 96 conversations
    # turns 2-4 extend their session's last turn: the replica prefills only the observation
    assert result["session_tokens_reused_per_turn"] > result["prefill_tokens_per_turn"] > 0
    # a conversation's turns leave nothing in reference cycles: the collector's pauses stay small at 1,000
    assert result["gc_garbage"] == 0 and result["event_loop"] in ("uvloop", "asyncio")
    # two runs: each one's figures, their medians, the worst lag and the slowest rate
    assert result["repeats"] == 2 and len(result["runs"]) == 2
    assert result["loop_lag_p99_ms_max"] == max(r["loop_lag_p99_ms"] for r in result["runs"])
    assert result["turn_req_s_min"] == min(r["turn_req_s"] for r in result["runs"]) <= result["turn_req_s"]
    assert out.count("run 1/2:") == out.count("run 2/2:") == 1 and "median of 2 runs" in out


def test_delivery_counts_lost_duplicated_and_short_conversations():
    sent = [("sample_0_0", "ok", [(0, 4), (1, 4)]), ("sample_0_1", "ok", [(0, 4), (1, 3)]),
            ("sample_0_1", "failed", [(0, 4)]), ("sample_0_9", "ok", [(0, 4)])]
    assert bench_scale_agent.check_delivery(["sample_0_0", "sample_0_1", "sample_0_2"], sent, n=2, turns=4) == {
        "lost": 2, "duplicated": 2, "bad_turns": 1, "failed": 1}  # sample_0_2 lost; a second 0_1 and an unadmitted 0_9


def test_tool_latency_has_the_median_and_p99_asked_for():
    import numpy as np

    latency = bench_scale_agent.ToolLatency(0.2, 2.0, seed=0)
    draws = np.array([latency.draw() for _ in range(20000)])
    assert abs(np.median(draws) - 0.2) < 0.01 and 1.7 < np.percentile(draws, 99) < 2.3


def test_host_niceness_is_refused_outside_0_to_19_naming_the_flag(capsys):
    assert bench_scale.parse_args(["--host-niceness", "15"]).host_niceness == 15
    for bad in ("-3", "20"):
        with pytest.raises(SystemExit):
            bench_scale.parse_args(["--host-niceness", bad])
        assert f"--host-niceness must be 0-19 (a process can only lower its own priority), got {bad}" in capsys.readouterr().err


def test_the_lag_timer_counts_a_wake_before_its_10_ms_as_no_lag():
    # uvloop's whole-millisecond timers end some 10 ms sleeps a little early when the loop is busy in
    # sub-millisecond slices (a fifth of 300 wakes, measured): each such wake is recorded as 0, never below
    async def run() -> list[float]:
        lags, stop = [], asyncio.Event()

        async def busy() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                while time.perf_counter() - t < 0.0007:
                    pass
                await asyncio.sleep(0)

        load = asyncio.create_task(busy())
        timer = asyncio.create_task(bench_scale_agent._lag_timer(lags, [], {"live": 0}, stop))
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(load, timer)
        return lags

    lags = bench_scale_agent.run_on("uvloop", run())
    assert len(lags) >= 50 and min(lags) >= 0 and max(lags) > 0, (len(lags), min(lags), max(lags))
    assert lags.count(0.0) >= 1  # the early wakes happened (and were counted 0), else this test shows nothing
