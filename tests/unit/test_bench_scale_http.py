"""``scripts/bench_scale.py --agent --http``, small: every episode an OpenAI-client agent over real
HTTP; each admitted episode ends in one sent group with all its calls on one branch (no fork), and
the JSON last line carries the issue's keys beside the in-process path's CPU per turn (the clients
in their own process: their CPU counted apart from the server's; the endpoint in its own process:
its CPU counted in the server's)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_scale  # noqa: E402

KEYS = {"http", "episodes", "loop_lag_p99_ms", "calls_s", "cpu_ms_per_call", "cpu_ms_per_call_inprocess", "lost",
        "duplicated", "cpu_ms_per_call_server", "cpu_ms_per_call_clients", "http_clients", "endpoint_server",
        "endpoint_loop_lag_p99_ms", "cpu_ms_per_call_rollouter", "cpu_ms_per_call_endpoint_process"}


@pytest.mark.timeout(120)
def test_http_episodes_end_in_one_group_each_with_every_call(capsys):
    result = bench_scale.main(["--agent", "--http", "--json", "--agent-conversations", "32", "--agent-rounds", "2",
                               "--agent-replicas", "4", "--tool-median-s", "0.005", "--tool-p99-s", "0.02"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert KEYS <= result.keys() and result["http"] is True
    assert result["episodes"] == 64 and result["lost"] == result["duplicated"] == 0
    assert result["bad_turns"] == result["failed"] == 0  # every episode's 4 calls extended one branch
    assert result["calls_s"] > 0 and result["cpu_ms_per_call"] > 0 and result["cpu_ms_per_call_inprocess"] > 0
    # the clients ran in their own process (the default): its CPU is counted apart, and in the total
    assert result["http_clients"] == "process" and result["cpu_ms_per_call_clients"] > 0
    assert result["cpu_ms_per_call"] == pytest.approx(result["cpu_ms_per_call_server"] + result["cpu_ms_per_call_clients"],
                                                      abs=2e-3)
    # the endpoint served from its own process (the default): its CPU is the server's beside the Rollouter's
    assert result["endpoint_server"] == "process" and result["cpu_ms_per_call_endpoint_process"] > 0
    assert result["cpu_ms_per_call_server"] == pytest.approx(
        result["cpu_ms_per_call_rollouter"] + result["cpu_ms_per_call_endpoint_process"], abs=2e-3)
