"""The restart loop's policy: a process that died is restarted from the checkpoint, an error in
the code stops the run with its traceback (`asyncrl.faults`, `asyncrl.launch.run_restarting`)."""

from __future__ import annotations

import asyncio
import json
import threading
import traceback

import numpy as np
import pytest
import ray.exceptions
import torch

from asyncrl import launch
from asyncrl.config import load_config
from asyncrl.faults import programming_error
from asyncrl.hang import HangError
from asyncrl.queue.memory import MemorySink
from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
from asyncrl.rollouter.engines.builtin import TorchEngine
from asyncrl.trainer.batch import IncompleteGroupError, screen_groups
from asyncrl.usercode import UserCodeError


def _refused(groups) -> IncompleteGroupError:
    with pytest.raises(IncompleteGroupError) as e:
        screen_groups(groups)  # the Trainer's default: fail closed
    return e.value


async def test_a_reward_with_a_type_error_stops_the_rollouter_as_a_user_error_naming_the_prompt(model_path):
    torch.set_num_threads(1)

    threads = []

    def reward(prompt, response_ids):  # a plain function: it runs on the Rollouter's reward threads
        threads.append(threading.current_thread().name)
        return "1" + len(response_ids)  # the bug: str + int

    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        producer = MemorySink()
        r = Rollouter(RolloutConfig(n=1, max_tokens=2, groups_per_sync=10), [engine], producer,
                      [Prompt(text="p", prompt_ids=np.array([1, 4, 5]))], reward)
        with pytest.raises(UserCodeError) as raised:  # rollout.on_user_error=stop, the default
            await asyncio.wait_for(r.run(num_groups=1), 60)
    finally:
        await engine.close()
    assert producer.groups == []  # nothing sent: the run stops on it
    assert threads and all(t.startswith("asyncrl-reward") for t in threads), threads
    e = raised.value
    assert e.line() == ("the reward function (test_a_reward_with_a_type_error_stops_the_rollouter_as_a_user_error_"
                        "naming_the_prompt.<locals>.reward) raised TypeError: can only concatenate str (not \"int\") "
                        "to str (on prompt sample_0_0 'p')")
    assert 'return "1" + len(response_ids)' in e.user_traceback  # the user's own line
    assert programming_error(e) == "UserCodeError"


async def test_an_engine_failure_in_a_group_is_not_a_programming_error():
    class OutOfMemory:
        async def generate(self, request):
            raise RuntimeError("engine out of memory")

    producer = MemorySink()
    r = Rollouter(RolloutConfig(n=2, max_tokens=2, groups_per_sync=10), [OutOfMemory()], producer,
                  [Prompt(text="p", prompt_ids=np.array([1, 4, 5]))], lambda p, ids: 1.0)
    await asyncio.wait_for(r.run(num_groups=1), 60)
    assert programming_error(_refused(producer.groups)) is None


def test_errors_raised_in_actors_are_judged_by_their_cause():
    try:
        raise AttributeError("'Batch' object has no attribute 'advantage'")
    except AttributeError as cause:  # as Ray re-raises it in the caller
        remote = ray.exceptions.RayTaskError("TrainerWorker.train_step", traceback.format_exc(), cause)
    assert programming_error(remote.as_instanceof_cause()) == "AttributeError"
    assert programming_error(KeyError("rewards")) == "KeyError"
    # What a restart heals: a process that died or hung, a collective broken by a dead peer.
    for healed in (ray.exceptions.ActorDiedError(), HangError("no train step completed for 600 s"),
                   RuntimeError("[gloo] Connection closed by peer"), TimeoutError("engine[0] not ready")):
        assert programming_error(healed) is None, healed


def _restart_loop(tmp_path, monkeypatch, failures: list[BaseException]) -> tuple[int, list[int]]:
    """`run_restarting` over a run that raises ``failures`` in turn, then returns 0."""
    cfg, _ = load_config([], ["max_restarts=2", "restart_backoff_s=0"])
    calls = []

    async def run(cfg_, plan, run_dir):
        calls.append(len(calls))
        if failures:
            raise failures.pop(0)
        return 0

    monkeypatch.setattr(launch, "run", run)
    # Re-planning after a restart asks Ray for the nodes: here the plan is the same one.
    from asyncrl import placement

    monkeypatch.setattr(placement, "alive_nodes", lambda: [])
    monkeypatch.setattr(placement, "make_plan", lambda cfg_, cluster: "plan")
    return launch.run_restarting(cfg, "plan", placement.Cluster(nodes=[], started_here=False), tmp_path), calls


def test_a_dead_process_restarts_the_run_and_a_type_error_stops_it_with_its_traceback(tmp_path, monkeypatch,
                                                                                       capsys):
    code, calls = _restart_loop(tmp_path, monkeypatch, [ray.exceptions.ActorDiedError()])
    assert code == 0 and calls == [0, 1]
    (line,) = (tmp_path / "restarts.jsonl").read_text().splitlines()
    assert json.loads(line)["cause"].startswith("ActorDiedError")
    (tmp_path / "restarts.jsonl").unlink()

    def score(response):
        return response + 1  # a reward's bug, raised in the run

    try:
        score("19")
    except TypeError as e:
        bug = e
    with pytest.raises(TypeError) as raised:
        _restart_loop(tmp_path, monkeypatch, [bug])
    assert raised.value is bug and any(f.name == "score" for f in traceback.extract_tb(raised.value.__traceback__))
    assert not (tmp_path / "restarts.jsonl").exists()
    err = capsys.readouterr().err
    assert "not restarting: TypeError" in err and f"--resume {tmp_path}" in err


def test_past_its_restarts_the_run_exits_1_naming_the_fault_and_resume(tmp_path, monkeypatch, capsys):
    failures = [TimeoutError(f"trainer ranks not up ({k})") for k in range(3)]
    code, calls = _restart_loop(tmp_path, monkeypatch, failures)
    assert code == 1 and calls == [0, 1, 2]  # the first run and max_restarts=2 more
    err = capsys.readouterr().err
    assert ("asyncrl: the run failed (no restart left (max_restarts=2 used)): TimeoutError: trainer ranks not up (2)"
            in err) and f"--resume {tmp_path}" in err


def _died(cls: str, pid: int) -> ray.exceptions.ActorDiedError:
    """The error Ray raises in the caller when the process of an actor of class ``cls`` died."""
    import os

    from ray.core.generated.common_pb2 import ActorDiedErrorContext

    return ray.exceptions.ActorDiedError(ActorDiedErrorContext(
        class_name=cls, actor_id=os.urandom(16), pid=pid,
        error_message="The actor is dead because its worker process has died."))


def test_a_restart_names_the_process_that_died_and_the_checkpoint_it_starts_from(tmp_path, monkeypatch, capsys):
    from asyncrl.trainer import checkpoint

    _restart_loop(tmp_path, monkeypatch, [_died("TrainerWorker", 4242)])
    staged = checkpoint.staging_path(tmp_path / "checkpoints", 6)
    checkpoint.publish(tmp_path / "checkpoints", staged, checkpoint.TrainerState(step=6, version=6))
    _restart_loop(tmp_path, monkeypatch, [_died("RolloutWorker", 77), _died("EngineActor", 5)])
    causes = [json.loads(line)["cause"] for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert causes[0].startswith("ActorDiedError: a trainer rank (TrainerWorker, pid 4242) died")
    assert causes[1].startswith("ActorDiedError: the Rollouter (RolloutWorker, pid 77) died")
    assert causes[2].startswith("ActorDiedError: an engine (EngineActor, pid 5) died")
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("asyncrl: restart ")]
    assert "from the start (no checkpoint yet)" in lines[0] and "TrainerWorker, pid 4242" in lines[0]
    assert all(f"from its checkpoint of step 6 ({tmp_path / 'checkpoints' / 'step_000006'})" in x for x in lines[1:])


async def test_a_run_that_stops_without_a_new_checkpoint_names_the_one_it_continues_from(tmp_path, capsys):
    """A dead trainer rank once read "no checkpoint" while the run had one: the line names the newest."""
    from types import SimpleNamespace

    from asyncrl.progress import checkpoint_after_failure
    from asyncrl.trainer import checkpoint

    broken = SimpleNamespace(broken="trainer rank 1 (TrainerWorker, pid 9) died")
    await checkpoint_after_failure(broken, RuntimeError("rank died"), tmp_path)
    assert "no new checkpoint (trainer rank 1 (TrainerWorker, pid 9) died)" in capsys.readouterr().err
    staged = checkpoint.staging_path(tmp_path / "checkpoints", 4)
    checkpoint.publish(tmp_path / "checkpoints", staged, checkpoint.TrainerState(step=4, version=4))
    await checkpoint_after_failure(broken, RuntimeError("rank died"), tmp_path)
    err = capsys.readouterr().err
    assert f"from its checkpoint of step 4 ({tmp_path / 'checkpoints' / 'step_000004'})" in err


async def test_a_replica_that_fails_to_start_again_is_retried_with_backoff_then_left_out_by_name(capsys):
    """`EngineRestarter`: a new replica that dies before it is ready uses up a restart
    (engine.max_restarts), the next sync's `notice` (the replica is still dead to the coordinator)
    starts it again after a longer backoff, and past the limit it is left out with a line naming
    it and why; nothing waits on it, nothing raises."""
    from asyncrl.processes import EngineRestarter

    tries: list[float] = []

    class NeverReady:  # the new actor's constructor fails: its ready() call raises
        class ready:
            @staticmethod
            async def remote():
                raise RuntimeError("CUDA out of memory while loading the model")

    def start_engine(i: int):
        assert i == 1
        tries.append(asyncio.get_running_loop().time())
        return NeverReady

    restarter = EngineRestarter(start_engine, max_restarts=2, backoff_s=0.2)
    dead = {"engine[1]": "actor died"}  # what the coordinator lists after each sync
    loop = asyncio.get_running_loop()
    noticed = []
    for _ in range(2):
        noticed.append(loop.time())
        restarter.notice(dead)  # a sync ends with the replica dead
        assert restarter.ready() == {}  # the next sync begins: the start is not done yet
        await asyncio.wait_for(asyncio.gather(restarter.starting[1], return_exceptions=True), 30)
        assert restarter.ready() == {} and not restarter.starting  # it failed: nothing joins
    restarter.notice(dead)
    assert restarter.left_out == {1} and not restarter.starting and restarter.restarts == {1: 2}
    assert [t - n >= 0.2 * k for k, (t, n) in enumerate(zip(tries, noticed), 1)] == [True, True]  # backoff k x 0.2 s
    restarter.notice(dead)  # left out for good: no further try
    assert len(tries) == 2
    out = capsys.readouterr().out
    assert "asyncrl: engine[1] died (actor died); starting it again (1/2) in 0.2 s" in out
    assert ("asyncrl: engine[1] did not start again (RuntimeError('CUDA out of memory while loading the model')); "
            "starting it again (2/2) in 0.4 s") in out
    assert ("asyncrl: engine[1] did not start again (RuntimeError('CUDA out of memory while loading the model')); "
            "left out: engine.max_restarts=2 used") in out
    assert out.count("left out") == 1


def test_a_group_dropped_for_a_user_error_is_dropped_by_the_trainer_whatever_on_incomplete_group():
    from asyncrl.types import Group
    from asyncrl.usercode import USER_ERROR_KEY

    line = "rollout.agent.env=m:E raised ValueError: no (on prompt sample_0_1 '7*8=')"
    marked = Group(sample_id="sample_0_1", trajectories=[], expected=2, status="failed", error=line,
                   meta={USER_ERROR_KEY: line})
    failed = Group(sample_id="sample_0_2", trajectories=[], expected=2, status="failed", error="0: engine died")
    assert screen_groups([marked]) == ([], [("sample_0_1", f"user_error: {line}")])
    with pytest.raises(IncompleteGroupError, match=r"\['sample_0_2'\]"):  # any other failed group still fails closed
        screen_groups([marked, failed])


async def test_a_validation_reward_that_raises_is_a_user_error_naming_the_prompt():
    from asyncrl.rollouter.rewards import score

    def checks(prompt, response_ids):
        raise ValueError(f"no answer in {len(response_ids)} tokens")

    with pytest.raises(UserCodeError) as raised:
        await score(checks, Prompt(text="12*3=", prompt_ids=np.array([1, 2])), np.array([5, 6, 7]))
    assert raised.value.line() == ("the reward function (test_a_validation_reward_that_raises_is_a_user_error_naming_"
                                   "the_prompt.<locals>.checks) raised ValueError: no answer in 3 tokens (on prompt "
                                   "'12*3=')")
    assert programming_error(raised.value) == "UserCodeError"  # the launcher does not restart on it
