"""`SimEngine`: the engine semantics with simulated tokens and time (for control-plane scale runs).

Time is only ever bounded from below here (a request cannot end before its steps have passed);
every other check waits on the engine's own state (the `until` fixture of conftest.py).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from asyncrl.rollouter.engines.base import EngineClosedError, EngineError, EnginePausedError, RolloutEngine
from asyncrl.rollouter.engines.sim import SimEngine, SimEngineConfig
from asyncrl.types import GenerateRequest, SamplingParams


def req(rid: str, max_tokens: int = 400, seed: int | None = None) -> GenerateRequest:
    return GenerateRequest(rid, np.array([1, 5, 6]), max_tokens=max_tokens, sampling=SamplingParams(seed=seed))


def test_config_errors_name_the_field():
    for kwargs, field in [({"tokens_per_s": 0}, "tokens_per_s"), ({"max_running": 0}, "max_running"),
                          ({"long_tail": 3}, "long_tail"), ({"vocab_size": 3}, "vocab_size")]:
        with pytest.raises(ValueError, match=f"SimEngineConfig.{field}"):
            SimEngineConfig(**kwargs)


async def test_lengths_follow_the_long_tail_and_end_with_stop_or_length():
    engine = SimEngine(tokens_per_s=1e6, max_running=256, median_tokens=4, long_tail=16)
    assert isinstance(engine, RolloutEngine)
    try:
        results = await asyncio.gather(*(engine.generate(req(f"r{i}", max_tokens=32, seed=i)) for i in range(1000)))
    finally:
        await engine.close()
    lengths = np.array([len(r.response_ids) for r in results])
    assert set(lengths.tolist()) <= {4, 8, 16, 32}  # 4 x 2**k, the 64-token draws capped at 32
    assert 0.64 < np.mean(lengths == 4) < 0.76  # 0.7 at the median
    for r in results:
        n = len(r.response_ids)
        assert r.finish_reason == ("length" if n == 32 else "stop")
        assert (r.response_ids[-1] == 2) == (r.finish_reason == "stop")  # EOS ends a stopped response only
        assert len(r.logprobs) == len(r.versions) == n and (r.logprobs <= 0).all() and (r.versions == 0).all()
    # the same seed draws the same response, on any replica
    other = SimEngine(tokens_per_s=1e6, max_running=256, median_tokens=4, long_tail=16)
    again = await other.generate(req("x", max_tokens=32, seed=7))
    await other.close()
    assert again.response_ids.tolist() == results[7].response_ids.tolist()


async def test_tokens_come_on_the_clock_in_batches_of_max_running():
    # 4 slots at 400 tokens/s: a step every 10 ms, one token per running request per step
    engine = SimEngine(tokens_per_s=400, max_running=4, median_tokens=10, long_tail=1)
    try:
        t0 = time.monotonic()
        results = await asyncio.gather(*(engine.generate(req(f"r{i}")) for i in range(8)))
        elapsed = time.monotonic() - t0
    finally:
        await engine.close()
    assert [len(r.response_ids) for r in results] == [10] * 8
    assert elapsed >= 2 * 10 * 0.010 * 0.95  # two waves of 10 steps: the second waits for a slot
    assert engine.stats()["tokens_generated"] == 80 and engine.stats()["prefill_tokens"] == 8 * 3


async def test_keep_freezes_requests_and_tokens_after_the_update_carry_the_new_version(until):
    engine = SimEngine(tokens_per_s=2000, max_running=4, median_tokens=200, long_tail=1)
    try:
        tasks = [asyncio.create_task(engine.generate(req(f"k{i}"))) for i in range(4)]
        await until(lambda: all(n >= 5 for n in engine.progress([f"k{i}" for i in range(4)]).values())
                    and engine.stats()["running"] == 4)
        await engine.pause("keep")
        frozen = engine.progress([f"k{i}" for i in range(4)])
        late = asyncio.create_task(engine.generate(req("late")))  # queued while paused
        await until(lambda: engine.stats()["queued"] == 1)
        await asyncio.sleep(0.05)  # 20 steps' worth of time, paused
        assert engine.progress(frozen) == frozen and engine.progress(["late"]) == {"late": 0}
        await engine.load_weights([])
        await engine.finish_weight_update(1)
        await engine.resume()
        for task, rid in zip(tasks, frozen):
            res = await task
            n = frozen[rid]
            assert res.finish_reason == "stop" and len(res.response_ids) == 200  # its drawn 200 < the budget
            assert (res.versions[:n] == 0).all() and (res.versions[n:] == 1).all()  # every token once
        assert ((await late).versions == 1).all()
        assert engine.stats()["reprefill_tokens"] == 0
        with pytest.raises(EngineError, match="pause"):
            await engine.load_weights([])  # not while generating
    finally:
        await engine.close()


async def test_abort_and_pause_abort_return_partial_output_and_refuse_until_resume(until):
    engine = SimEngine(tokens_per_s=2000, max_running=2, median_tokens=400, long_tail=1)
    try:
        a = asyncio.create_task(engine.generate(req("a")))
        b = asyncio.create_task(engine.generate(req("b")))
        queued = asyncio.create_task(engine.generate(req("q")))
        await until(lambda: engine.progress(["a"]).get("a", 0) >= 3 and engine.stats()["queued"] == 1)
        await engine.abort(["a"])
        part = await a
        assert part.finish_reason == "abort" and 3 <= len(part.response_ids) < 400
        await until(lambda: engine.progress(["q"]).get("q", 0) >= 1)  # the freed slot went to the queued one
        await engine.pause("abort")
        for task in (b, queued):
            res = await task
            assert res.finish_reason == "abort" and 0 < len(res.response_ids) < 400
        with pytest.raises(EnginePausedError, match="mode='abort'"):
            await engine.generate(req("refused"))
        await engine.resume()
        assert len((await engine.generate(req("after", max_tokens=3))).response_ids) == 3
    finally:
        await engine.close()


async def test_wait_drains_clear_cache_counts_the_reprefill_and_close_fails_what_is_left(until):
    # 4 slots, 10 ms steps: each wave of requests takes 80 ms, so all 6 are still in flight here
    engine = SimEngine(tokens_per_s=400, max_running=4, median_tokens=8, long_tail=1)
    try:
        tasks = [asyncio.create_task(engine.generate(req(f"w{i}"))) for i in range(6)]
        await asyncio.sleep(0)  # each task has queued its request
        assert engine.stats()["requests"] == 6 and engine.stats()["running"] + engine.stats()["queued"] == 6
        await engine.pause("wait")
        assert engine.stats()["running"] == engine.stats()["queued"] == 0
        assert [len(r.response_ids) for r in await asyncio.gather(*tasks)] == [8] * 6
        with pytest.raises(EnginePausedError, match="mode='wait'"):
            await engine.generate(req("refused"))
    finally:
        await engine.close()
    engine = SimEngine(tokens_per_s=4000, max_running=4, median_tokens=5000, long_tail=1)
    try:
        long = asyncio.create_task(engine.generate(req("long", max_tokens=10_000)))
        await until(lambda: engine.progress(["long"]).get("long", 0) >= 4)
        await engine.pause("keep", clear_cache=True)
        assert engine.stats()["reprefill_tokens"] == 3 + engine.progress(["long"])["long"]
    finally:
        await engine.close()
    with pytest.raises(EngineClosedError):
        await long


async def test_the_rollouter_completes_groups_over_many_simulated_replicas():
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter

    engines = [SimEngine(tokens_per_s=5000, max_running=8, median_tokens=4, long_tail=4, seed=e) for e in range(32)]
    prompts = [Prompt(text=f"p{i}", prompt_ids=np.array([1, 2, 3])) for i in range(64)]
    sink = MemorySink()
    try:
        cfg = RolloutConfig(n=4, max_tokens=16, groups_per_sync=1000, max_concurrent=64)
        await asyncio.wait_for(Rollouter(cfg, engines, sink, prompts, lambda p, r: float(len(r))).run(num_groups=64), 60)
    finally:
        await asyncio.gather(*(e.close() for e in engines))
    assert len(sink.groups) == 64 and all(g.status == "ok" and g.complete for g in sink.groups)
    served = [e.stats()["requests"] for e in engines]
    assert sum(served) == 64 * 4 and sum(s > 0 for s in served) >= 16  # spread over the replicas


async def test_a_cancelled_caller_frees_its_slot_and_the_actor_builds_the_kind(until):
    from asyncrl.rollouter.actor import EngineActor

    actor = EngineActor(kind="sim", tokens_per_s=1000, max_running=1, median_tokens=10_000, long_tail=1)
    engine = actor.engine
    try:
        hog = asyncio.create_task(actor.generate(req("hog", max_tokens=20_000)))
        waiting = asyncio.create_task(actor.generate(req("next", max_tokens=5)))
        await until(lambda: engine.stats()["running"] == 1 and engine.stats()["queued"] == 1)
        hog.cancel()
        res = await asyncio.wait_for(waiting, 30)  # the slot went to the queued request
        assert res.finish_reason == "length" and len(res.response_ids) == 5
        assert "hog" not in engine.progress(["hog"])
    finally:
        await actor.close()


async def test_an_id_in_flight_is_refused_and_free_again_once_it_ended(until):
    engine = SimEngine(tokens_per_s=2000, max_running=1, median_tokens=400, long_tail=1)
    try:
        first = asyncio.create_task(engine.generate(req("same")))
        await until(lambda: engine.stats()["running"] == 1)
        with pytest.raises(ValueError, match="already in flight"):
            await engine.generate(req("same"))
        await engine.abort(["same"])
        assert (await first).finish_reason == "abort"
        assert len((await engine.generate(req("same", max_tokens=3))).response_ids) == 3
    finally:
        await engine.close()


def turn(rid: str, prompt, session: str | None = "s", seed: int = 1) -> GenerateRequest:
    return GenerateRequest(rid, np.asarray(prompt, dtype=np.int64), max_tokens=400, session_id=session,
                           sampling=SamplingParams(seed=seed))


async def test_a_turn_that_extends_its_session_prefills_only_its_new_tokens():
    engine = SimEngine(tokens_per_s=1e6, max_running=8, median_tokens=3, long_tail=1)
    try:
        prompt = np.arange(3, 13)  # 10 tokens
        first = await engine.generate(turn("t0", prompt))
        assert engine.stats()["prefill_tokens"] == 10 and engine.stats()["session_live"] == 1
        context = np.concatenate([prompt, first.response_ids, [7, 8]])  # turn, then a 2-token observation
        second = await engine.generate(turn("t1", context))
        s = engine.stats()
        assert s["prefill_tokens"] == 10 + 2 and s["session_hits"] == 1
        assert s["session_tokens_reused"] == 10 + len(first.response_ids)
        # a prompt that does not extend the kept turn prefills whole
        diverged = np.concatenate([context[:-1], [9], second.response_ids, [4]])
        third = await engine.generate(turn("t2", diverged))
        assert engine.stats()["prefill_tokens"] == 12 + len(diverged)
        assert engine.stats()["session_misses"] == 1
        # t2's turn is kept, but the weights changed since: its extension prefills whole
        before = engine.stats()["prefill_tokens"]
        await engine.pause("keep")
        await engine.finish_weight_update(1)
        await engine.resume()
        extended = np.concatenate([diverged, third.response_ids, [5]])
        await engine.generate(turn("t3", extended))
        assert engine.stats()["prefill_tokens"] == before + len(extended)
        assert engine.stats()["session_misses"] == 2 and engine.stats()["session_hits"] == 1
        # after end_session the next turn prefills whole too; another session never shares
        await engine.end_session("s")
        assert engine.stats()["session_live"] == 0
        await engine.generate(turn("o", prompt, session="other"))
        assert engine.stats()["session_hits"] == 1 and engine.stats()["session_live"] == 1
    finally:
        await engine.close()


async def test_prefill_takes_time_for_new_tokens_only():
    # 1,000 prompt tokens a second: a 300-token prompt waits >= 0.3 s before its first token
    engine = SimEngine(tokens_per_s=1e5, max_running=8, median_tokens=2, long_tail=1, prefill_tokens_per_s=1000)
    try:
        t0 = time.monotonic()
        first = await engine.generate(turn("a", np.arange(300) % 50 + 3))
        assert time.monotonic() - t0 >= 0.3
        assert engine.progress(["a"]) == {}
        t0 = time.monotonic()
        await engine.generate(turn("b", np.concatenate([np.arange(300) % 50 + 3, first.response_ids, [5]])))
        hit_s = time.monotonic() - t0
        assert engine.stats()["prefill_tokens"] == 301 and engine.stats()["session_hits"] == 1
        t0 = time.monotonic()
        await engine.generate(turn("c", np.arange(300) % 50 + 3, session=None))  # no session: whole prompt again
        miss_s = time.monotonic() - t0
        assert miss_s >= 0.3 and engine.stats()["prefill_tokens"] == 601
        # The hit waited one token's prefill (1 ms), the miss 300 tokens' (0.3 s): an order, not a bound.
        assert hit_s < miss_s
    finally:
        await engine.close()
