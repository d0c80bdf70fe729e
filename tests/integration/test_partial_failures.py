"""An engine actor killed mid-round (partial rollout, sync mode's workflow, Ray actors): its
requests go again to the live replica (same seed), so no group fails and none is sent
half-finished, the aggregator's signal does not wait on the dead replica, and the run does
not hang. (With every replica dead
the requests fail their groups, which the Trainer fails closed on: tests/unit/test_batch.py.)"""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest
import ray
import torch

from asyncrl.models.tiny import build_tiny_model
from asyncrl.rollouter.actor import remote_engine_actor
from asyncrl.rollouter.aggregator import remote_aggregator_actor
from asyncrl.rollouter.partial import PartialRolloutConfig
from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
from asyncrl.trainer.batch import screen_groups
from asyncrl.queue.memory import MemorySink

N, G = 2, 2


# this module's Ray, as the conftest's ray_cluster starts it
RAY_INIT = {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}


async def sync_live(engines, version):
    """A weight sync without new weights: pause, bump the version, resume, on every live engine."""
    for e in engines:
        try:
            await e.pause.remote("keep")
            await e.finish_weight_update.remote(version)
            await e.resume.remote()
        except ray.exceptions.RayActorError:
            pass


@pytest.mark.timeout(300)
async def test_engine_killed_mid_round_its_requests_go_to_the_live_replica_and_the_run_finishes(ray_cluster, tmp_path):
    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "tiny")
    cls = remote_engine_actor(num_cpus=0)
    engines = [cls.remote(kind="torch", model_path=str(model), eos_token_ids=(), seed=0) for _ in range(2)]
    await asyncio.gather(*(e.ready.remote() for e in engines))
    aggregator = remote_aggregator_actor().remote(engines, G * N, signal_timeout_s=10.0)
    cfg = RolloutConfig(n=N, max_tokens=4, groups_per_sync=G, staleness_threshold=1.0, max_concurrent=8,
                        request_timeout_s=60)
    prompts = [Prompt(text=f"p{i}", prompt_ids=np.array([1, 4 + i, 5], dtype=np.int64),
                      max_tokens=64) for i in range(8)]
    producer = MemorySink()
    r = Rollouter(cfg, engines, producer, prompts, lambda prompt, ids: 1.0,
                  partial=PartialRolloutConfig(enable=True, max_age=2, truncate_at="threshold"), aggregator=aggregator)
    run = asyncio.create_task(r.run(num_groups=10))
    victim_pid = await engines[1].__ray_call__.remote(lambda self: os.getpid())
    # Kill replica 1 once it is generating (a long request is in flight on it).
    async with asyncio.timeout(120):
        while (await engines[1].stats.remote())["running"] == 0:
            await asyncio.sleep(0.05)
    os.kill(victim_pid, signal.SIGKILL)
    version = 0
    async with asyncio.timeout(200):
        while not run.done():
            done, _ = await asyncio.wait({run}, timeout=0.5)
            if not done and sum(g.status == "ok" for g in producer.groups) >= (version + 1) * G:
                version += 1
                await r.on_pause()
                await sync_live(engines, version)
                await r.on_sync(version)
        await run
    for e in engines:
        ray.kill(e)
    ray.kill(aggregator)

    # The dead replica's requests went again (same seed) to the live one: nothing failed, nothing
    # half-finished was sent, and the Trainer's fail-closed screen passes every group.
    assert len(producer.groups) == 10
    assert r.stats_now()["dead_engines"] == 1 and r.failed == 0
    assert all(g.status == "ok" and g.complete for g in producer.groups), \
        [(g.sample_id, g.status, g.error) for g in producer.groups]
    kept, dropped = screen_groups(producer.groups)
    assert len(kept) == 10 and not dropped
