"""The launcher's local Ray start: a raylet that did not register within Ray's fixed 30 s (a loaded
machine) is started again, any other failure is raised at once. Ray's slow start cannot be made
to happen on demand, so ``ray.init`` is replaced by a stand-in that fails as Ray does."""

from types import SimpleNamespace

import pytest

from asyncrl import placement
from asyncrl.rpc.auth import RUN_KEY_ENV, run_env

RAY_TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.")


def _stand_in(monkeypatch, failures):
    import ray

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if failures:
            raise failures.pop(0)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.setattr(placement, "alive_nodes", lambda: [])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def test_a_raylet_slow_to_register_gets_a_fresh_start(monkeypatch, capsys):
    calls = _stand_in(monkeypatch, [RAY_TIMEOUT, RAY_TIMEOUT])
    placement.connect(SimpleNamespace(address=None), cpu_actors=3)
    assert [c if c == "shutdown" else "init" for c in calls] == ["init", "shutdown", "init", "shutdown", "init"]
    assert capsys.readouterr().out.count("did not start in time") == 2


def test_it_gives_up_after_three_starts_and_other_errors_are_not_retried(monkeypatch):
    _stand_in(monkeypatch, [RAY_TIMEOUT] * 3)
    with pytest.raises(Exception, match="timed out during startup"):
        placement.connect(SimpleNamespace(address=None), cpu_actors=3)
    calls = _stand_in(monkeypatch, [ValueError("bad num_cpus")])
    with pytest.raises(ValueError, match="bad num_cpus"):
        placement.connect(SimpleNamespace(address=None), cpu_actors=3)
    assert len(calls) == 1


def test_the_local_ray_s_workers_keep_the_launcher_s_priority_unless_the_environment_says(monkeypatch):
    import os

    import ray

    # Ray renices its workers to 15 by default; the launcher's local Ray keeps them at the launcher's own.
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert placement.same_priority() == {"worker_niceness": 0}
    placement.connect(SimpleNamespace(address=None), cpu_actors=1)
    try:
        niceness = ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote(), timeout=120)
    finally:
        ray.shutdown()
    assert niceness == os.nice(0)
    monkeypatch.setenv("RAY_worker_niceness", "15")  # a user's own choice stands
    assert placement.same_priority() == {}


def test_the_benchmarks_and_tests_start_their_local_ray_the_same_way(monkeypatch, capsys):
    # `start_local_ray` (the launcher's start, for the benchmarks' and tests' own local Rays): a new
    # local instance, no dashboard, the caller's system config with the workers' priority merged in,
    # the run's call key handed to every process of it, and the same fresh start after a raylet slow
    # to register.
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    calls = _stand_in(monkeypatch, [RAY_TIMEOUT])
    said = []
    placement.start_local_ray(num_cpus=2, log_to_driver=False, _system_config={"a": 1}, say=said.append)
    init = calls[-1]
    assert calls[1] == "shutdown" and len(calls) == 3 and len(said) == 1 and "did not start in time" in said[0]
    key = run_env()[RUN_KEY_ENV]
    assert len(bytes.fromhex(key)) >= 32
    assert init == {"address": "local", "include_dashboard": False, "num_cpus": 2, "log_to_driver": False,
                    "_system_config": {"a": 1, "worker_niceness": 0},
                    "runtime_env": {"env_vars": {RUN_KEY_ENV: key}}}
    assert capsys.readouterr().out == ""  # retries are told through `say` only
