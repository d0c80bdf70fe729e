"""The staleness gate gets back the budget of groups the Trainer drops: a drop policy that drops
many groups never starves the Trainer. Real Rollouter, engine, Trainer (one local rank).

On-policy (``staleness_threshold=0``) the gate admits exactly the groups one step needs; every
other prompt's first response is aborted mid-flight (as an operator's abort or a preempted
engine would), so half the groups arrive incomplete and the Trainer drops them. Unless the
drops give their budget back, the Trainer waits for groups that are never admitted."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from asyncrl.models.tiny import build_tiny_model, build_tokenizer
from asyncrl.rollouter.rollouter import Prompt, RolloutConfig
from asyncrl.rollouter.engines.builtin.engine import TorchEngine
from asyncrl.trainer.config import OptimConfig, TrainerConfig, WorkerConfig
from tests.unit.inprocess import train_steps

G, N, STEPS = 2, 2, 6


class AbortingEngine:
    """The real engine; the first response of every even-indexed prompt is aborted after one token."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, request):
        sample_id, k = request.request_id.split("/")[:2]
        task = asyncio.ensure_future(self.engine.generate(request))
        try:
            if k == "0" and int(sample_id.rsplit("_", 1)[1]) % 2 == 0:
                while not task.done():
                    if await self.engine.wait_for_tokens(request.request_id, 1, timeout_s=30) >= 1:
                        await self.engine.abort([request.request_id])
                        break
                    await asyncio.sleep(0)  # not queued yet: generate has not run
            return await task
        finally:
            task.cancel()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


async def test_dropped_groups_give_budget_back_and_the_trainer_is_never_starved(model_path):
    tok = build_tokenizer()
    tcfg = TrainerConfig(worker=WorkerConfig(model_path=str(model_path), pad_token_id=tok.pad_token_id,
                                             optim=OptimConfig(lr=1e-3)),
                         groups_per_batch=G, on_incomplete_group="drop", recv_timeout_s=60)
    rcfg = RolloutConfig(n=N, max_tokens=24, groups_per_sync=tcfg.groups_per_sync, staleness_threshold=0.0)
    prompts = [Prompt(text=f"p{i}", prompt_ids=np.array([1, 4 + i, 5], dtype=np.int64)) for i in range(8)]
    engine = TorchEngine(model_path, seed=0, eos_token_ids=())
    results, rollouter, trainer, stream = await train_steps(tcfg, rcfg, engine, prompts, lambda text, ids: float(ids[0] % 2),
                                                            STEPS, serving=AbortingEngine(engine))
    dropped = [sid for r in results for sid, why in r.dropped]
    # Half of all groups were dropped as incomplete, yet every step trained its G groups.
    assert len(dropped) >= STEPS * G - 1, dropped
    assert all(why.startswith("incomplete") for r in results for _, why in r.dropped)
    assert all(len(r.sample_ids) == G for r in results) and trainer.version == STEPS
    assert set(dropped) <= rollouter.given_back and rollouter.failed == 0
    # The gate stayed on-policy: never more admitted than the budget, drops given back.
    assert rollouter.admitted - len(rollouter.given_back) <= (trainer.version + 1) * G
    assert {sid for sid, why in stream.acks if why} == set(dropped)
