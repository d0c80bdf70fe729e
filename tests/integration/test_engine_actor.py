"""EngineActor under Ray: real actors, real processes, the built-in engine inside."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import ray
import torch

from asyncrl.models.tiny import build_tiny_model
from asyncrl.rollouter.actor import EngineActor, remote_engine_actor
from asyncrl.rollouter.engines import make_engine
from asyncrl.types import GenerateRequest, SamplingParams


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), initializer_range=0.2)


@pytest.fixture(scope="module")
def actors(ray_cluster, model_path):
    cls = remote_engine_actor(num_cpus=0.5)
    handles = [
        cls.remote(kind="torch", model_path=str(model_path), max_running=16, eos_token_ids=(), num_threads=1)
        for _ in range(2)
    ]
    ray.get([h.ready.remote() for h in handles], timeout=120)
    yield handles
    ray.get([h.close.remote() for h in handles], timeout=60)
    for h in handles:
        ray.kill(h)


def _requests(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        GenerateRequest(
            f"q{i}",
            rng.integers(3, 40, size=int(rng.integers(2, 12))),
            max_tokens=int(rng.integers(4, 24)),
            sampling=SamplingParams(temperature=1.0, seed=i),
        )
        for i in range(n)
    ]


async def test_64_concurrent_requests_across_two_actors(actors):
    reqs = _requests(64)
    refs = [actors[i % 2].generate.remote(r) for i, r in enumerate(reqs)]
    results = await asyncio.wait_for(asyncio.gather(*refs), timeout=240)
    assert sorted(r.request_id for r in results) == sorted(r.request_id for r in reqs)
    for q, r in zip(reqs, results):
        assert r.request_id == q.request_id and r.finish_reason == "length"
        assert len(r.response_ids) == len(r.logprobs) == len(r.versions) == q.max_tokens
        assert (r.logprobs <= 0).all()
    stats = await asyncio.gather(*(a.stats.remote() for a in actors))
    assert sum(s["tokens_generated"] for s in stats) >= sum(q.max_tokens for q in reqs)
    assert all(s["running"] == 0 and s["queued"] == 0 for s in stats)


async def _until_generated(actor, request_id: str, n_tokens: int, timeout_s: float = 60.0) -> int:
    """``request_id``'s token count once it reached ``n_tokens``.

    Ray may start an async actor's calls out of submission order, so `wait_for_tokens` can run
    before `generate` has queued the request; it then returns 0 at once, and is asked again.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        got = await actor.wait_for_tokens.remote(request_id, n_tokens)
        if got >= n_tokens or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.01)


async def test_pause_keep_weight_load_and_abort_through_the_actor(actors, model_path):
    actor = actors[0]
    local = make_engine("torch", model_path=str(model_path))
    try:
        meta = await actor.param_meta.remote()
        assert meta == local.param_meta()
        weights = [(n, p.detach().clone()) for n, p in local.model.named_parameters()]
    finally:
        await local.close()
    greedy = SamplingParams(greedy=True)
    kept = actor.generate.remote(GenerateRequest("kept", np.arange(3, 9), max_tokens=40, sampling=greedy))
    assert await _until_generated(actor, "kept", 3) >= 3
    await actor.pause.remote("keep")
    await actor.load_weights.remote(weights)
    await actor.finish_weight_update.remote(5)
    assert await actor.version.remote() == 5
    await actor.resume.remote()
    result = await kept
    k = int((result.versions == 0).sum())
    assert result.finish_reason == "length" and 3 <= k < 40
    np.testing.assert_array_equal(result.versions, [0] * k + [5] * (40 - k))

    cut = actor.generate.remote(GenerateRequest("cut", np.arange(3, 9), max_tokens=200, sampling=greedy))
    assert await _until_generated(actor, "cut", 2) >= 2
    await actor.abort.remote(["cut"])
    partial = await cut
    assert partial.finish_reason == "abort" and 2 <= len(partial.response_ids) < 200
    assert (partial.versions == 5).all()


async def test_actor_class_in_process(model_path):
    actor = EngineActor(kind="torch", model_path=str(model_path), eos_token_ids=())
    try:
        r = await actor.generate(GenerateRequest("x", np.arange(3, 7), max_tokens=5))
        assert len(r.response_ids) == 5 and (await actor.version()) == 0
        with pytest.raises(ValueError, match="kind"):
            EngineActor(kind="tpu")
    finally:
        await actor.close()


async def _gone(handle, timeout_s: float = 60.0) -> bool:
    """True once the actor is gone (its ``ready`` call fails with an actor error)."""
    try:
        await asyncio.wait_for(handle.ready.remote(), timeout_s)
    except ray.exceptions.RayActorError:
        return True
    return False


async def test_a_restart_in_progress_at_shutdown_is_cancelled_killed_and_reported(ray_cluster, capsys):
    """`EngineRestarter` closed with the run (`Processes.stack`, as `asyncrl.starters.start_restarter`
    registers it): a restart under way (a real actor Ray cannot place: it asks for a resource the
    cluster lacks) is cancelled and its actor killed; a failed one (its engine cannot be built) is
    reported with why; both named; nothing of either outlives the close."""
    from types import SimpleNamespace

    from asyncrl.processes import Processes
    from asyncrl.restarts import EngineRestarter

    started: dict[int, object] = {}

    def start_engine(i: int):
        if i == 1:  # still waiting for its placement when the run closes
            actor = remote_engine_actor(num_cpus=0, resources={"no-such-accelerator": 1})
        else:  # its engine cannot be built: the start fails
            actor = remote_engine_actor(num_cpus=0.1)
        started[i] = actor.remote(kind="no-such-kind")
        return started[i]

    released: list[bool] = []
    procs = Processes(plan=SimpleNamespace(release=lambda: released.append(True)), engines=[])
    procs.stack.callback(procs.plan.release)
    restarter = EngineRestarter(start_engine, max_restarts=1, backoff_s=0.0)
    procs.stack.push_async_callback(restarter.close, ray.kill)  # as `asyncrl.starters.start_restarter` does

    restarter.notice({"engine[1]": "actor died", "engine[2]": "actor died"})  # a sync found both dead
    tasks = dict(restarter.starting)
    await asyncio.wait_for(asyncio.gather(tasks[2], return_exceptions=True), 60)  # engine[2]'s start failed
    assert set(started) == {1, 2} and not tasks[1].done()  # engine[1]'s restart is under way
    await asyncio.wait_for(procs.close(), 60)

    assert tasks[1].cancelled() and not restarter.starting and released == [True]  # closed, then the plan
    assert await _gone(started[1]) and await _gone(started[2])  # neither actor outlives the run
    out = capsys.readouterr().out
    assert "asyncrl: engine[1] its restart was under way at shutdown: cancelled" in out
    assert "asyncrl: engine[2] did not start again (" in out and "no-such-kind" in out
    assert isinstance(restarter.start_errors[2], ray.exceptions.RayActorError)
    restarter.notice({"engine[1]": "actor died"})  # a sync racing the close starts nothing more
    assert not restarter.starting and len(started) == 2
