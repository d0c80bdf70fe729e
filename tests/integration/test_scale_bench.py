"""``scripts/bench_scale.py`` (the control plane over simulated replicas) runs end to end and
measures what it says, small; ``scripts/soak.py`` reads a growing events file as the run writes it."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_scale  # noqa: E402
import soak  # noqa: E402


@pytest.mark.timeout(600)  # 94 s alone, 216 s in a full suite run (2026-11-26): 300 was too close
def test_bench_scale_drives_the_rollouter_syncs_and_aggregator_at_two_sizes(capsys):
    # (the Ray-actor-call baseline, --modes ray-calls, is left to the bench's own runs: the Rollouter's
    # path through Ray actor calls is tested in test_rpc.py)
    result = bench_scale.main(["--replicas", "1", "8", "--warmup-s", "0.5", "--seconds", "1.5",
                               "--paced-seconds", "1.5", "--modes", "ray", "in-process", "--agg-seconds", "1.5",
                               "--probe-s", "0.05", "--hosts", "2", "--json"])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == json.loads(json.dumps(result))
    assert result["replicas"] == [1, 8] and result["ray_hop"] is True  # the headline figures cross Ray
    inside = result["in_process"]  # the same runs with the replicas in the Rollouter's process, beside
    for i in range(2):
        for figures in (result, inside):
            assert figures["req_s"][i] > 50 and 0 < figures["cpu_ms_per_req"][i] < 50
            fanout = [figures[f"sync_fanout_{q}_ms"][i] for q in ("p50", "p99", "max")]
            assert 0 < fanout[0] <= fanout[1] <= fanout[2], fanout
            assert 0.5 < figures["engine_calls_per_group"][i] < 1.5  # a group's requests go in one call
            assert figures["rss_mb"][i] > 50
        assert result["agg_lag_p99_ms"][i] is not None and result["agg_lag_p99_ms"][i] > 0  # rounds ended
    assert result["cpu_ratio_vs_8"] == inside["cpu_ratio_vs_8"] == 1.0  # the largest size is 8 itself
    assert "replicas in 2 Ray actor processes (fewer when fewer replicas), called over zmq:" in out
    assert "replicas in process (no Ray):" in out and "ray_calls" not in result
    assert "plan: 64 engine replica(s) of 4 GPU(s), 256 trainer rank(s) on 64 node(s)" in out
    assert result["plan_64_nodes_s"] > 0


def test_soak_reads_events_as_they_are_written_and_gives_stepless_ones_to_the_latest_step(tmp_path):
    path = tmp_path / "events.jsonl"
    tail = soak.MetricsTail(path)
    assert tail.poll() == {}
    event = {"name": "timing_s/step", "value": 0.5, "step": 1, "version": 1, "time": 0.0, "source": "trainer"}
    line = json.dumps(event) + "\n"
    credit = json.dumps({**event, "name": "stream/credit", "value": 7.0, "step": -1, "source": "rollouter"})
    path.write_text(line + credit[:20])  # the Rollouter's event half written
    assert tail.poll() == {1: {"timing_s/step": 0.5}}
    with path.open("a") as f:
        f.write(credit[20:] + "\n" + json.dumps({**event, "step": 2, "value": 0.7}) + "\n")
    assert tail.poll() == {1: {"timing_s/step": 0.5, "stream/credit": 7.0}, 2: {"timing_s/step": 0.7}}
    assert tail.latest == {"timing_s/step": 0.7, "stream/credit": 7.0}


@pytest.mark.timeout(180)
def test_bench_scale_agent_through_ray_actors_loses_no_conversation(capsys):
    # The replicas in two Ray actor processes, every turn and end_session over asyncrl.rpc.
    result = bench_scale.main(["--agent", "--json", "--agent-repeats", "1", "--agent-conversations", "48",
                               "--agent-rounds", "2", "--agent-replicas", "4", "--agent-hosts", "2",
                               "--tool-median-s", "0.005", "--tool-p99-s", "0.02"])
    assert "4 simulated replicas in 2 Ray actor processes, called over zmq" in capsys.readouterr().out
    assert result["hosts"] == 2 and result["conversations_sent"] == 96 and result["mean_turns"] == 4.0
    assert result["lost"] == result["duplicated"] == result["bad_turns"] == result["failed"] == 0
    assert result["turn_requests"] == 96 * 4  # each turn one engine request, none repeated
    assert result["session_tokens_reused_per_turn"] > result["prefill_tokens_per_turn"] > 0  # sessions kept
