"""Weight sync end to end: 2 FSDP2 trainer ranks (Ray actors, gloo world) -> 2 EngineActors
(TorchEngine) over the weight-sync group, driven by `WeightSyncCoordinator`.

Real processes throughout; trainer weights are changed between syncs by adding seeded noise
to each rank's local shard (``__ray_call__``), and read back with ``full_state_dict``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import numpy as np
import psutil
import pytest
import ray
import torch

from asyncrl.models.tiny import build_tiny_model
from asyncrl.rollouter.actor import remote_engine_actor
from asyncrl.sync.coordinator import WeightSyncConfig, WeightSyncCoordinator
from asyncrl.sync.wire import WeightSyncError
from asyncrl.trainer.config import TrainerConfig, WorkerConfig
from asyncrl.trainer.ranks import RankGroup
from asyncrl.types import GenerateRequest, SamplingParams

# the helpers below run inside the actors: ship them by value (the test module is not importable there)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CFG = WeightSyncConfig(bucket_mb=0.02, connect_timeout_s=60, pause_timeout_s=30, transfer_timeout_s=60,
                       resume_timeout_s=30)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0, initializer_range=0.2)


# this module's Ray, as the conftest's ray_cluster starts it
RAY_INIT = {"num_cpus": 4, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}


@pytest.fixture(scope="module")
def trainer(ray_cluster, model_path):
    cfg = TrainerConfig(worker=WorkerConfig(model_path=str(model_path), device="cpu"), world_size=2,
                        cpus_per_rank=0.5, rank_start_timeout_s=120)
    group = RankGroup.start_ray(cfg)
    yield group
    group.close()


@pytest.fixture(scope="module")
def engines(ray_cluster, model_path):
    # shared by the tests of this module, in file order; the last one kills engines[1]
    cls = remote_engine_actor(num_cpus=0.5)
    handles = [cls.remote(kind="torch", model_path=str(model_path), max_running=8, eos_token_ids=(), num_threads=1)
               for _ in range(2)]
    ray.get([h.ready.remote() for h in handles], timeout=120)
    yield handles
    for h in handles:
        try:
            ray.get(h.close.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        ray.kill(h)


def _perturb(worker, seed):
    # every rank adds its own seeded noise to its local shard of every parameter
    g = torch.Generator().manual_seed(seed * 100 + worker.rank)
    with torch.no_grad():
        for p in worker.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(torch.randn(local.shape, generator=g) * 0.05)


async def _trainer_params(trainer) -> dict[str, torch.Tensor]:
    states = await trainer.call("full_state_dict", timeout=60)
    return states[0]


async def _engine_params(h) -> dict[str, torch.Tensor]:
    fn = lambda self: {n: p.detach().clone() for n, p in self.engine.model.named_parameters(remove_duplicate=False)}  # noqa: E731
    return await h.__ray_call__.remote(fn)


async def _assert_equal(trainer, engines):
    want = await _trainer_params(trainer)
    for i, h in enumerate(engines):
        got = await _engine_params(h)
        assert set(got) <= set(want) | {"lm_head.weight"}
        for name, t in got.items():
            src = want[name] if name in want else want["model.embed_tokens.weight"]
            assert torch.equal(t, src), f"engine[{i}] {name} is not the trainer's"
    return want


async def test_three_syncs_land_bitwise_and_metadata_goes_once(trainer, engines):
    coord = WeightSyncCoordinator(trainer.workers, engines, CFG)
    before = await _trainer_params(trainer)
    for step in (1, 2, 3):
        await trainer.call("__ray_call__", [(_perturb, step), (_perturb, step)], timeout=60)
        assert await coord.sync() == step
        want = await _assert_equal(trainer, engines)
        assert not torch.equal(want["model.norm.weight"], before["model.norm.weight"])
        before = want
        assert [await h.version.remote() for h in engines] == [step, step]
    sender_stats = await trainer.workers[0].__ray_call__.remote(lambda self: dict(self._sender.stats))
    assert sender_stats["meta_sends"] == 1 and sender_stats["syncs"] == 3
    assert sender_stats["peak_extra_bytes"] > 0
    for h in engines:
        stats = await h.__ray_call__.remote(lambda self: dict(self._receiver.stats))
        assert stats["meta_received"] == 1 and stats["syncs"] == 3
    assert coord.last.attempts == 1 and coord.last.failed == {}


async def test_republish_after_a_resume_loads_the_weights_and_keeps_the_version(trainer, engines):
    # A resumed run: a fresh coordinator at the restored version, the ranks hold restored weights
    # the engines lack. republish() puts them in without counting a sync.
    version = await engines[0].version.remote()
    coord = WeightSyncCoordinator(trainer.workers, engines, CFG, version=version)
    await trainer.call("__ray_call__", [(_perturb, 77), (_perturb, 77)], timeout=60)
    assert await coord.republish() == version and coord.version == version
    await _assert_equal(trainer, engines)
    assert [await h.version.remote() for h in engines] == [version, version]
    assert await coord.sync() == version + 1  # the next sync counts on from the restored version


async def _coordinator(trainer, engines, cfg=CFG, clear_cache=False):
    versions = {await h.version.remote() for h in engines}
    assert len(versions) == 1
    return WeightSyncCoordinator(trainer.workers, engines, cfg, version=versions.pop(), clear_cache=clear_cache)


async def _mid_flight(h, request_id: str, n: int) -> int:
    # An async actor may start wait_for_tokens before the generate call submitted just
    # before it (Ray does not order async actor tasks), and then it answers 0 at once.
    for _ in range(100):
        got = await h.wait_for_tokens.remote(request_id, n)
        if got:
            return got
    raise AssertionError(f"{request_id} never showed up in flight")


@pytest.mark.parametrize("clear_cache", [False, True], ids=["keep-kv", "reread-prefix"])
async def test_sync_with_requests_in_flight_freezes_and_continues_on_new_version(trainer, engines, clear_cache):
    # clear_cache: async mode's partial rollout, each in-flight response truncated at the sync
    # in place and its prefix re-read under the new weights.
    coord = await _coordinator(trainer, engines, clear_cache=clear_cache)
    v1 = await coord.sync()  # the group is up before requests start
    rng = np.random.default_rng(0)
    reqs = [GenerateRequest(f"r{i}", rng.integers(3, 40, size=6), max_tokens=240,
                            sampling=SamplingParams(temperature=1.0, seed=i)) for i in range(4)]
    refs = [engines[i % 2].generate.remote(r) for i, r in enumerate(reqs)]
    watched = reqs[:2]  # the first request of each engine
    for h, r in zip(engines, watched):
        # pause as soon as it is mid-flight, so it cannot finish before the sync (the
        # coordinator's own pause then finds the engine already frozen, which keep allows)
        assert await _mid_flight(h, r.request_id, 3) >= 3
        await h.pause.remote("keep", clear_cache)
    await trainer.call("__ray_call__", [(_perturb, 7), (_perturb, 7)], timeout=60)
    v2 = await coord.sync()
    assert v2 == v1 + 1
    results = await asyncio.wait_for(asyncio.gather(*refs), 120)
    for r in results:
        assert len(r.response_ids) == 240 and r.finish_reason == "length"
        v = r.versions.tolist()
        # frozen at pause: a run of old-version tokens, then only new-version tokens
        assert v == sorted(v) and set(v) <= {v1, v2} and v[-1] == v2, f"{r.request_id}: versions {v}"
        if r.request_id in {w.request_id for w in watched}:
            assert v.count(v1) >= 3
    for h, r in zip(engines, watched):
        stats = await h.stats.remote()
        # kept: never prefilled again; re-read: at least the watched request's prompt + 3 tokens
        assert (stats["reprefill_tokens"] >= len(r.prompt_ids) + 3) if clear_cache else stats["reprefill_tokens"] == 0
        assert stats["version"] == v2
    await _assert_equal(trainer, engines)


class _HangingPause:
    """Engine handle proxy whose pause never returns (a wedged engine)."""

    def __init__(self, handle):
        self._h = handle
        self.pause = self

    def remote(self, *args):
        return asyncio.sleep(3600)

    def __getattr__(self, name):
        return getattr(self._h, name)


async def test_a_wedged_engine_is_named_with_the_setting_and_the_other_still_syncs(trainer, engines):
    cfg = WeightSyncConfig(**{**CFG.__dict__, "pause_timeout_s": 4.0})
    coord = await _coordinator(trainer, engines, cfg)
    start = coord.version
    coord.engines["engine[1]"] = _HangingPause(engines[1])
    await trainer.call("__ray_call__", [(_perturb, 5), (_perturb, 5)], timeout=60)
    with pytest.raises(WeightSyncError, match=r"engine\[1\] \(engine\[1\]: pause did not finish within "
                                              r"WeightSyncConfig.pause_timeout_s=4.0s\); resumed on version "
                                              + str(start + 1) + r": engine\[0\]"):
        await coord.sync()
    assert list(coord.engines) == ["engine[0]", "engine[1]"] and not coord.dead  # wedged, not dead
    assert await engines[0].version.remote() == start + 1
    assert await engines[1].version.remote() == start  # never paused, so never loaded: old weights whole
    await _assert_equal(trainer, engines[:1])
    # the engine recovers: the next sync re-forms the group with both and both land
    coord.engines["engine[1]"] = engines[1]
    assert await coord.sync() == start + 2
    await _assert_equal(trainer, engines)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _Killing:
    """Engine handle proxy: the engine process is SIGKILLed right after its ``method`` call returns, or
    with ``before``, as the call is made (the call then meets a dead actor)."""

    def __init__(self, handle, pid, method: str, before: bool = False):
        self._h, self._pid, self._method, self._before = handle, pid, method, before
        setattr(self, method, self)
        self.killed = False

    def _kill(self):
        os.kill(self._pid, signal.SIGKILL)
        psutil.Process(self._pid).wait(30)  # reaped by Ray's raylet; gone before we go on
        self.killed = True

    def remote(self, *args):
        async def call():
            if self._before:
                self._kill()
            out = await getattr(self._h, self._method).remote(*args)
            if not self._before:
                self._kill()
            return out

        return call()

    def __getattr__(self, name):
        return getattr(self._h, name)


def _torch_engine(model_path):
    """A built-in engine actor on the module's tiny model, besides the fixture's two."""
    return remote_engine_actor(num_cpus=0.5).remote(kind="torch", model_path=str(model_path), eos_token_ids=(),
                                                    num_threads=1)


async def test_engine_killed_during_sync_is_named_and_the_other_serves_new_version(trainer, engines):
    start = await engines[0].version.remote()
    coord = WeightSyncCoordinator(trainer.workers, {"engine-a": engines[0], "engine-b": engines[1]}, CFG,
                                  version=start)
    assert await coord.sync() == start + 1  # the group is formed; now lose a member of it
    pid = await engines[1].__ray_call__.remote(lambda self: os.getpid())
    proxy = _Killing(engines[1], pid, "pause")
    coord.engines["engine-b"] = proxy
    await trainer.call("__ray_call__", [(_perturb, 11), (_perturb, 11)], timeout=60)
    v = start + 2
    with pytest.raises(WeightSyncError, match=rf"version {v} failed for engine-b .*resumed on version {v}: engine-a"):
        await asyncio.wait_for(coord.sync(), CFG.pause_timeout_s + 2 * CFG.transfer_timeout_s)
    assert proxy.killed and not _running(pid)
    assert list(coord.engines) == ["engine-a"] and "engine-b" in coord.dead
    assert coord.version == v and coord.last.attempts == 2
    # the survivor holds the full new set and serves it
    await _assert_equal(trainer, engines[:1])
    res = await engines[0].generate.remote(GenerateRequest("after", np.array([5, 6, 7]), max_tokens=4))
    assert res.versions.tolist() == [v] * 4
    # nothing hangs: the trainer ranks still answer collectives, and a later sync reaches the survivor
    await trainer.call("__ray_call__", [(_perturb, 12), (_perturb, 12)], timeout=60)
    assert await coord.sync() == v + 1
    await _assert_equal(trainer, engines[:1])


def _die_on_third_bucket(self):
    # Inside the engine actor: the third bucket load kills this process (SIGKILL, no cleanup),
    # so it dies mid-broadcast with two buckets of the new version already in its model.
    load, calls = self.engine.load_weights, []

    async def load_weights(named):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        await load(named)

    self.engine.load_weights = load_weights
    return os.getpid()


async def test_engine_killed_mid_broadcast_leaves_the_survivor_with_a_whole_new_set(trainer, engines, model_path):
    survivor = engines[0]
    victim = _torch_engine(model_path)
    await victim.ready.remote()
    try:
        coord = WeightSyncCoordinator(trainer.workers, {"survivor": survivor, "victim": victim}, CFG,
                                      version=await survivor.version.remote())
        v1 = await coord.sync()
        pid = await victim.__ray_call__.remote(_die_on_third_bucket)
        await trainer.call("__ray_call__", [(_perturb, 21), (_perturb, 21)], timeout=60)
        with pytest.raises(WeightSyncError, match=rf"version {v1 + 1} failed for victim .*: survivor$"):
            await coord.sync()
        assert not _running(pid) and "victim" in coord.dead and coord.last.attempts == 2
        # the survivor's first attempt broke off when the trainer dropped the group (peer
        # closed), not by waiting out transfer_timeout_s
        first = coord.last.attempt_errors[0]
        assert "receiving bucket" in first["survivor"] and "Timed out" not in first["survivor"], first
        assert coord.last.attempt_errors[1] == {}
        assert await survivor.version.remote() == v1 + 1
        await _assert_equal(trainer, [survivor])
    finally:
        ray.kill(victim)


async def test_an_engine_killed_between_its_weights_and_its_resume_is_dropped_and_the_next_sync_goes_on(
        trainer, engines, model_path):
    survivor = engines[0]
    victim = _torch_engine(model_path)
    await victim.ready.remote()
    try:
        coord = WeightSyncCoordinator(trainer.workers, {"survivor": survivor, "victim": victim}, CFG,
                                      version=await survivor.version.remote())
        v1 = await coord.sync()
        pid = await victim.__ray_call__.remote(lambda self: os.getpid())
        proxy = coord.engines["victim"] = _Killing(victim, pid, "resume", before=True)
        await trainer.call("__ray_call__", [(_perturb, 41), (_perturb, 41)], timeout=60)
        with pytest.raises(WeightSyncError, match=rf"version {v1 + 1} failed for victim \(victim: resume failed: .*\); "
                                                  rf"resumed on version {v1 + 1}: survivor$"):
            await coord.sync()
        assert proxy.killed and not _running(pid)
        # dropped at once (a restart brings it back), not left in the group for the next sync to trip on
        assert list(coord.engines) == ["survivor"] and "victim" in coord.dead and coord.version == v1 + 1
        await trainer.call("__ray_call__", [(_perturb, 42), (_perturb, 42)], timeout=60)
        assert await coord.sync() == v1 + 2 and coord.last.attempts == 1 and not coord.last.failed
        await _assert_equal(trainer, [survivor])
    finally:
        ray.kill(victim)


class _RolloutSide:
    """The Rollouter's side of `NotifyingSyncer` (its Ray handle's methods), recording what it is told."""

    def __init__(self):
        self.told: list[tuple] = []
        for name in ("on_pause", "on_sync", "replace_engine"):
            setattr(self, name, self._method(name))

    def _method(self, name):
        told = self.told

        class Method:
            @staticmethod
            async def remote(*args):
                told.append((name, *args))

        return Method


async def test_an_engine_killed_mid_broadcast_starts_again_and_serves_the_current_weights(trainer, engines, model_path):
    from asyncrl.processes import EngineRestarter, NotifyingSyncer

    def start_engine(i):
        return _torch_engine(model_path)

    survivor, victim = engines[0], start_engine(1)
    await victim.ready.remote()
    started: dict = {}
    coord = WeightSyncCoordinator(trainer.workers, [survivor, victim], CFG, version=await survivor.version.remote())
    restarter = EngineRestarter(start_engine, max_restarts=1, backoff_s=0.0)
    side = _RolloutSide()
    syncer = NotifyingSyncer(coord, side, restarter, on_engine=lambda i, h: started.update({i: h}))
    try:
        v1 = await syncer.sync()
        pid = await victim.__ray_call__.remote(_die_on_third_bucket)
        await trainer.call("__ray_call__", [(_perturb, 31), (_perturb, 31)], timeout=60)
        assert await syncer.sync() == v1 + 1  # the sync goes on with the survivor; the victim is started again
        assert not _running(pid) and "engine[1]" in coord.dead and 1 in restarter.starting
        await asyncio.wait_for(asyncio.shield(restarter.starting[1]), 120)  # ready
        assert not any(t[0] == "replace_engine" for t in side.told)  # no request before it has the weights
        await trainer.call("__ray_call__", [(_perturb, 32), (_perturb, 32)], timeout=60)
        v3 = await syncer.sync()  # it joins: the group forms anew and it gets this sync's weights
        assert v3 == v1 + 2 and coord.joined == 1 and list(coord.engines) == ["engine[0]", "engine[1]"]
        assert ("replace_engine", 1, started[1]) in side.told and side.told[-1] == ("on_sync", v3)
        await _assert_equal(trainer, [survivor, started[1]])
        res = await started[1].generate.remote(GenerateRequest("back", np.array([5, 6, 7]), max_tokens=4))
        assert res.versions.tolist() == [v3] * 4
        # Past engine.max_restarts a replica that dies again is left out, and the run goes on.
        ray.kill(started[1])
        assert await syncer.sync() == v3 + 1
        assert 1 in restarter.left_out and not restarter.starting
    finally:
        for h in [victim, *started.values()]:
            ray.kill(h)
