"""The built-in engine against transformers itself: tokens, log-probs, pause modes, weights."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from asyncrl.models.tiny import build_tiny_model
from asyncrl.rollouter.engines.builtin import model_runner
from asyncrl.rollouter.engines.base import EngineClosedError, EngineError, EnginePausedError
from asyncrl.rollouter.engines.builtin.engine import TorchEngine, TorchEngineConfig
from asyncrl.types import GenerateRequest, SamplingParams

GREEDY = SamplingParams(greedy=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    # A wider init than the default 0.02 gives peaked, varied logits: greedy tokens differ
    # from step to step and no two logits tie within float error.
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), initializer_range=0.2)


@pytest.fixture(scope="module")
def ref(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40, (n,), generator=g).numpy() for n in lengths]


def req(rid, prompt, max_tokens=24, sampling=GREEDY):
    return GenerateRequest(rid, np.asarray(prompt), max_tokens=max_tokens, sampling=sampling)


@torch.no_grad()
def hf_greedy(model, prompt, n, eos=False):
    """transformers' own greedy generate; ``eos=False`` matches an engine with ``eos_token_ids=()``."""
    x = torch.as_tensor(prompt)[None]
    kw = {} if eos else {"eos_token_id": None}
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, **kw)
    return out[0, len(prompt) :].numpy()


@torch.no_grad()
def full_forward_logprobs(model, prompt, response, temperature=1.0):
    ids = torch.as_tensor(np.concatenate([prompt, response]))[None]
    logp = torch.log_softmax(model(ids).logits[0].float() / temperature, -1)
    return logp[len(prompt) - 1 : -1].gather(1, ids[0, len(prompt) :, None])[:, 0].numpy()


async def test_greedy_equals_hf_generate_concurrently(model_path, ref):
    ps = prompts([2, 5, 9, 14, 3, 21, 7, 11, 4, 17])
    # max_running < number of requests: requests join and leave the batch mid-flight.
    engine = TorchEngine(model_path, max_running=4)
    try:
        results = await asyncio.gather(*(engine.generate(req(f"r{i}", p, 20 + i)) for i, p in enumerate(ps)))
    finally:
        await engine.close()
    for i, (p, r) in enumerate(zip(ps, results)):
        expected = hf_greedy(ref, p, 20 + i, eos=True)
        np.testing.assert_array_equal(r.response_ids, expected, err_msg=f"request r{i}")
        assert r.finish_reason == ("stop" if expected[-1] == ref.config.eos_token_id else "length")
        assert (r.versions == 0).all()
    assert engine.stats()["tokens_generated"] == sum(len(r.response_ids) for r in results)


async def test_logprobs_equal_full_forward(model_path, ref):
    ps = prompts([3, 8, 13, 6], seed=1)
    samplings = [
        GREEDY,
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, seed=2),
        SamplingParams(temperature=1.3, top_k=5),
    ]
    engine = TorchEngine(model_path, max_running=8, eos_token_ids=())
    try:
        results = await asyncio.gather(
            *(engine.generate(req(f"r{i}", p, 30, s)) for i, (p, s) in enumerate(zip(ps, samplings)))
        )
    finally:
        await engine.close()
    for p, s, r in zip(ps, samplings, results):
        assert len(r.response_ids) == 30 and r.finish_reason == "length"
        temp = 1.0 if s.greedy else s.temperature
        expected = full_forward_logprobs(ref, p, r.response_ids, temp)
        assert np.abs(expected - r.logprobs).max() <= 1e-4


async def test_seeded_sampling_does_not_depend_on_batch(model_path):
    p = prompts([6], seed=2)[0]
    s = SamplingParams(temperature=1.0, seed=7)
    engine = TorchEngine(model_path, max_running=8, eos_token_ids=())
    try:
        alone = await engine.generate(req("alone", p, 20, s))
        others = [engine.generate(req(f"o{i}", q, 25, SamplingParams())) for i, q in enumerate(prompts([4, 9, 2]))]
        crowded, *_ = await asyncio.gather(engine.generate(req("crowded", p, 20, s)), *others)
    finally:
        await engine.close()
    np.testing.assert_array_equal(alone.response_ids, crowded.response_ids)
    assert len(set(alone.response_ids.tolist())) > 3  # really sampled, not a constant


async def _start(engine, requests, first_id, n_tokens):
    tasks = [asyncio.create_task(engine.generate(r)) for r in requests]
    await asyncio.sleep(0)  # let the requests enqueue
    got = await engine.wait_for_tokens(first_id, n_tokens, timeout_s=60)
    assert got >= n_tokens
    return tasks


async def test_keep_resume_same_weights_is_uninterrupted(model_path, ref):
    ps = prompts([5, 12, 3], seed=3)
    engine = TorchEngine(model_path, max_running=4, eos_token_ids=())
    try:
        tasks = await _start(engine, [req(f"r{i}", p, 40) for i, p in enumerate(ps)], "r0", 5)
        await engine.pause("keep")
        before = engine.stats()
        assert before["running"] == 3 and before["kv_tokens"] > 0
        # A request arriving while paused with keep is queued, not refused.
        late = asyncio.create_task(engine.generate(req("late", ps[0], 10)))
        await asyncio.sleep(0)
        assert engine.stats()["queued"] == 1
        assert engine.stats()["tokens_generated"] == before["tokens_generated"]  # frozen
        await engine.resume()
        results = await asyncio.gather(*tasks, late)
    finally:
        await engine.close()
    for p, r in zip(ps, results):
        np.testing.assert_array_equal(r.response_ids, hf_greedy(ref, p, 40))
    np.testing.assert_array_equal(results[-1].response_ids, hf_greedy(ref, ps[0], 10))
    assert engine.stats()["reprefill_tokens"] == 0


def perturbed(model, seed=0, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach() + scale * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


@torch.no_grad()
def reference_swap(model_path, prompt, n_old, n_total, new_weights):
    """Greedy: n_old tokens with the old weights, swap weights in place, continue on the same KV."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    tokens, logprobs = [], []
    x = torch.as_tensor(prompt)[None]
    for i in range(n_total):
        if i == n_old:
            for name, p in model.named_parameters():
                p.copy_(new_weights[name])
        logits = model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1]
        tok = int(logits.argmax())
        tokens.append(tok)
        logprobs.append(float(torch.log_softmax(logits.float(), -1)[tok]))
        x = torch.tensor([[tok]])
    return np.array(tokens), np.array(logprobs)


async def test_keep_with_weight_update_continues_on_kv(model_path, ref):
    ps = prompts([4, 10], seed=4)
    new = perturbed(ref)
    engine = TorchEngine(model_path, max_running=4, eos_token_ids=())
    try:
        tasks = await _start(engine, [req(f"r{i}", p, 30) for i, p in enumerate(ps)], "r0", 6)
        await engine.pause("keep")
        # Load in two buckets, as the weight sync does.
        names = [n for n, *_ in engine.param_meta()]
        await engine.load_weights((n, new[n]) for n in names[: len(names) // 2])
        await engine.load_weights((n, new[n]) for n in names[len(names) // 2 :])
        await engine.finish_weight_update(1)
        await engine.resume()
        results = await asyncio.gather(*tasks)
    finally:
        await engine.close()
    assert engine.version == 1 and engine.stats()["reprefill_tokens"] == 0
    for p, r in zip(ps, results):
        k = int((r.versions == 0).sum())
        assert 0 < k < 30
        np.testing.assert_array_equal(r.versions, [0] * k + [1] * (30 - k))
        tokens, logprobs = reference_swap(model_path, p, k, 30, new)
        np.testing.assert_array_equal(r.response_ids, tokens)
        assert np.abs(r.logprobs - logprobs).max() <= 1e-4
        # The swap mattered: the old weights alone continue differently.
        assert not np.array_equal(r.response_ids, hf_greedy(ref, p, 30))


async def test_keep_clear_cache_reprefills(model_path, ref):
    ps = prompts([5, 8], seed=5)
    engine = TorchEngine(model_path, max_running=4, eos_token_ids=())
    try:
        tasks = await _start(engine, [req(f"r{i}", p, 30) for i, p in enumerate(ps)], "r0", 4)
        await engine.pause("keep", clear_cache=True)
        st = engine.stats()
        assert st["kv_tokens"] == 0
        held = st["reprefill_tokens"]
        await engine.resume()
        results = await asyncio.gather(*tasks)
    finally:
        await engine.close()
    for p, r in zip(ps, results):
        np.testing.assert_array_equal(r.response_ids, hf_greedy(ref, p, 30))
    # Each request re-prefilled its prompt and everything generated before the pause.
    assert held >= sum(len(p) + 4 for p in ps) - 2 and held == engine.stats()["reprefill_tokens"]


async def test_abort_mode_returns_partials_and_resubmission_completes(model_path, ref):
    ps = prompts([6, 9], seed=6)
    engine = TorchEngine(model_path, max_running=4, eos_token_ids=())
    try:
        tasks = await _start(engine, [req(f"r{i}", p, 30) for i, p in enumerate(ps)], "r0", 5)
        await engine.pause("abort")
        partials = await asyncio.gather(*tasks)
        with pytest.raises(EnginePausedError, match="mode='abort'"):
            await engine.generate(req("refused", ps[0]))
        await engine.resume()
        # Prompt + partial response, with the remaining budget, completes the response.
        rest = await asyncio.gather(
            *(
                engine.generate(req(f"again{i}", np.concatenate([p, r.response_ids]), 30 - len(r.response_ids)))
                for i, (p, r) in enumerate(zip(ps, partials))
            )
        )
    finally:
        await engine.close()
    for p, part, tail in zip(ps, partials, rest):
        assert part.finish_reason == "abort" and 0 < len(part.response_ids) < 30
        assert len(part.logprobs) == len(part.versions) == len(part.response_ids)
        np.testing.assert_array_equal(np.concatenate([part.response_ids, tail.response_ids]), hf_greedy(ref, p, 30))


async def test_abort_chosen_requests(model_path, ref):
    ps = prompts([4, 7, 5], seed=7)
    engine = TorchEngine(model_path, max_running=2, eos_token_ids=())
    try:
        tasks = await _start(engine, [req(f"r{i}", p, 25) for i, p in enumerate(ps)], "r0", 3)
        await engine.abort(["r0", "r2", "unknown"])  # r2 is still queued (2 slots)
        results = await asyncio.gather(*tasks)
    finally:
        await engine.close()
    assert [r.finish_reason for r in results] == ["abort", "length", "abort"]
    assert 3 <= len(results[0].response_ids) < 25 and len(results[2].response_ids) == 0
    np.testing.assert_array_equal(results[1].response_ids, hf_greedy(ref, ps[1], 25))


async def test_progress_counts_running_tokens_and_zero_for_queued(model_path):
    engine = TorchEngine(model_path, max_running=1, eos_token_ids=())
    try:
        tasks = await _start(engine, [req("r0", [5, 6, 7], 30), req("r1", [8, 9], 30)], "r0", 4)
        progress = engine.progress(["r0", "r1", "unknown"])
        assert progress.keys() == {"r0", "r1"}  # not in flight: left out
        assert 4 <= progress["r0"] < 30 and progress["r1"] == 0  # r1 waits for the one slot
        await engine.abort(["r0", "r1"])
        await asyncio.gather(*tasks)
        assert engine.progress(["r0", "r1"]) == {}
    finally:
        await engine.close()


async def test_wait_drains_in_flight_and_refuses_new(model_path, ref):
    ps = prompts([4, 7, 5], seed=8)
    engine = TorchEngine(model_path, max_running=2, eos_token_ids=())
    try:
        tasks = await _start(engine, [req(f"r{i}", p, 20) for i, p in enumerate(ps)], "r0", 2)
        await engine.pause("wait")  # returns once drained, queued r2 included
        assert all(t.done() for t in tasks)
        assert engine.stats()["running"] == engine.stats()["queued"] == 0
        with pytest.raises(EnginePausedError, match="mode='wait'"):
            await engine.generate(req("refused", ps[0]))
        await engine.resume()
        after = await engine.generate(req("after", ps[0], 20))
    finally:
        await engine.close()
    for p, t in zip(ps, tasks):
        assert t.result().finish_reason == "length"
        np.testing.assert_array_equal(t.result().response_ids, hf_greedy(ref, p, 20))
    np.testing.assert_array_equal(after.response_ids, hf_greedy(ref, ps[0], 20))


async def test_weights_boundaries(model_path, ref):
    engine = TorchEngine(model_path)
    try:
        meta = engine.param_meta()
        assert [n for n, *_ in meta] == [n for n, _ in ref.named_parameters()]
        assert "lm_head.weight" not in [n for n, *_ in meta]  # tied: listed once
        name, dtype, shape = meta[0]
        with pytest.raises(EngineError, match="paused"):
            await engine.load_weights([(name, torch.zeros(shape, dtype=dtype))])
        await engine.pause("keep")
        with pytest.raises(KeyError, match="nope"):
            await engine.load_weights([("nope", torch.zeros(1))])
        with pytest.raises(ValueError, match="shape"):
            await engine.load_weights([(name, torch.zeros(1))])
        await engine.load_weights([(name, torch.full(shape, 0.5, dtype=dtype))])
        assert bool((dict(engine.model.named_parameters())[name] == 0.5).all())
    finally:
        await engine.close()
    with pytest.raises(EngineClosedError):
        await engine.generate(req("late", prompts([3])[0]))


async def test_close_fails_in_flight(model_path):
    engine = TorchEngine(model_path, max_running=1, eos_token_ids=())
    tasks = await _start(engine, [req(f"r{i}", p, 200) for i, p in enumerate(prompts([3, 4]))], "r0", 1)
    await engine.pause("keep")
    await engine.close()
    for t in tasks:
        with pytest.raises(EngineClosedError):
            await t


def test_config_errors_name_the_field(model_path):
    with pytest.raises(ValueError, match="max_running"):
        TorchEngineConfig(model_path=model_path, max_running=0)
    with pytest.raises(ValueError, match="pause_timeout_s"):
        TorchEngineConfig(model_path=model_path, pause_timeout_s=0)
    with pytest.raises(ValueError, match="batch_wait_ms"):
        TorchEngineConfig(model_path=model_path, batch_wait_ms=-1)


@pytest.mark.parametrize("wait_ms", [0, 400])
async def test_requests_that_come_one_by_one_start_together_within_batch_wait_ms(model_path, ref, wait_ms):
    # Three requests 20 ms apart to an idle engine. With a wait they are gathered into its first
    # step (8 tokens each: 8 steps); without one the first starts alone and the others join later.
    ps = prompts([5, 9, 7], seed=23)
    engine = TorchEngine(model_path, eos_token_ids=(), batch_wait_ms=wait_ms)
    try:
        calls = []
        for k, p in enumerate(ps):
            calls.append(asyncio.create_task(engine.generate(req(f"r{k}", p, 8))))
            await asyncio.sleep(0.02)
        results = await asyncio.gather(*calls)
        steps = engine.stats()["steps"]
        assert steps == 8 if wait_ms else steps > 8
        for r, p in zip(results, ps):  # gathered or not, each is what transformers generates
            np.testing.assert_array_equal(r.response_ids, hf_greedy(ref, p, 8))
    finally:
        await engine.close()


async def test_scheduler_failure_reaches_callers(model_path):
    engine = TorchEngine(model_path, eos_token_ids=())

    def broken_forward(plan):
        raise RuntimeError("device lost")

    engine._runner.forward = broken_forward  # a fault inside the worker thread
    try:
        with pytest.raises(EngineError, match="device lost"):
            await engine.generate(req("a", prompts([4])[0]))
        with pytest.raises(EngineError, match="scheduler failed"):
            await engine.generate(req("b", prompts([4])[0]))
    finally:
        await engine.close()


async def test_cancelled_caller_frees_its_slot(model_path, ref):
    p = prompts([5], seed=9)[0]
    engine = TorchEngine(model_path, max_running=1, eos_token_ids=())
    try:
        (hog,) = await _start(engine, [req("hog", p, 500)], "hog", 2)
        hog.cancel()
        # With the only slot freed, the next request runs to completion.
        done = await engine.generate(req("next", p, 10))
    finally:
        await engine.close()
    np.testing.assert_array_equal(done.response_ids, hf_greedy(ref, p, 10))
    assert engine.stats()["running"] == 0


@pytest.mark.parametrize("pad_budget", [0, 10**6], ids=["prompts-apart", "prompts-in-decode-forward"])
async def test_prompts_with_or_beside_decodes_equal_generate(model_path, ref, monkeypatch, pad_budget):
    # Prompts of different lengths join while others decode: with a large budget they run in
    # the decode forward (right-padded queries), with none each prompt runs on its own.
    monkeypatch.setattr(model_runner, "PAD_BUDGET", pad_budget)
    forwards = []
    real = model_runner.ModelRunner._forward_rows
    monkeypatch.setattr(
        model_runner.ModelRunner, "_forward_rows", lambda self, *a: forwards.append(a[2:4]) or real(self, *a)
    )
    ps = prompts([9, 2, 15, 4, 11, 6], seed=11)
    engine = TorchEngine(model_path, max_running=3, eos_token_ids=())
    try:
        results = await asyncio.gather(*(engine.generate(req(f"r{i}", p, 12 + 3 * i)) for i, p in enumerate(ps)))
    finally:
        await engine.close()
    for i, (p, r) in enumerate(zip(ps, results)):
        np.testing.assert_array_equal(r.response_ids, hf_greedy(ref, p, 12 + 3 * i))
        assert np.abs(full_forward_logprobs(ref, p, r.response_ids) - r.logprobs).max() <= 1e-4
    steps = engine.stats()["steps"]
    if pad_budget:
        assert len(forwards) == steps  # one forward per step
    else:
        assert len(forwards) > steps and sum(hi - lo == 1 for lo, hi in forwards) >= len(ps) - 1


async def test_gpt2_learned_positions_equal_generate(tmp_path):
    # Any HF causal LM: GPT-2 has a learned position table (padded queries must stay inside
    # it) and its own attention code; responses run into its 40-position limit.
    from transformers import GPT2Config

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50, n_positions=40, n_embd=32, n_layer=2, n_head=2, initializer_range=0.2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    gpt2 = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ps = prompts([3, 12, 5, 9, 2], seed=12)
    engine = TorchEngine(tmp_path, max_running=3, eos_token_ids=())
    try:
        results = await asyncio.gather(*(engine.generate(req(f"r{i}", p, 40)) for i, p in enumerate(ps)))
    finally:
        await engine.close()
    for p, r in zip(ps, results):
        assert r.finish_reason == "length" and len(p) + len(r.response_ids) == 40
        np.testing.assert_array_equal(r.response_ids, hf_greedy(gpt2, p, 40 - len(p)))
        assert np.abs(full_forward_logprobs(gpt2, p, r.response_ids) - r.logprobs).max() <= 1e-4


async def test_kv_memory_counts_blocks_and_is_freed_by_clear_cache(model_path, ref):
    ps = prompts([5, 8, 3], seed=13)
    engine = TorchEngine(model_path, max_running=4, eos_token_ids=())
    try:
        tasks = await _start(engine, [req(f"r{i}", p, 30) for i, p in enumerate(ps)], "r1", 10)
        await engine.pause("keep")
        held = engine.kv_memory()
        cfg = ref.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # K+V, float32
        # Each request holds its cached tokens rounded up to whole blocks, no more.
        running = [s for s in engine._running.values()]
        blocks = sum(-(-s.cached // held["block_tokens"]) for s in running)
        assert held["used_bytes"] == blocks * held["block_tokens"] * per_token
        assert held["bytes"] >= held["used_bytes"] and held["peak_used_bytes"] >= held["used_bytes"]
        assert held["peak_tokens"] >= engine.stats()["kv_tokens"] > 0
        await engine.pause("keep", clear_cache=True)
        assert engine.kv_memory()["bytes"] == 0 and engine.kv_memory()["peak_bytes"] == held["peak_bytes"]
        await engine.resume()
        results = await asyncio.gather(*tasks)
    finally:
        await engine.close()
    for p, r in zip(ps, results):
        np.testing.assert_array_equal(r.response_ids, hf_greedy(ref, p, 30))
    assert engine.kv_memory()["used_bytes"] == 0  # every block back after the requests ended


async def test_group_shares_one_prefill_and_each_response_samples_its_own(model_path, ref):
    # The n responses of a group arrive together: the prompt is computed once, every response
    # gets its own seeded tokens, and its log-probs are those of a full forward.
    p = prompts([21], seed=14)[0]  # more than one block, the last one partly filled
    sampling = [SamplingParams(temperature=1.0, seed=100 + k) for k in range(6)]
    engine = TorchEngine(model_path, max_running=8, eos_token_ids=())
    try:
        group = await asyncio.gather(*(engine.generate(req(f"g{k}", p, 30, s)) for k, s in enumerate(sampling)))
        stats = engine.stats()
        alone = [await engine.generate(req(f"a{k}", p, 30, s)) for k, s in enumerate(sampling[:2])]
    finally:
        await engine.close()
    assert stats["prefill_tokens"] == len(p) and stats["shared_prefill_tokens"] == 5 * len(p)
    assert len({tuple(r.response_ids) for r in group}) == 6  # six different responses
    for r, a in zip(group, alone):  # the same seed alone gives the same tokens: sharing changes nothing
        np.testing.assert_array_equal(r.response_ids, a.response_ids)
    for r in group:
        assert np.abs(full_forward_logprobs(ref, p, r.response_ids) - r.logprobs).max() <= 1e-4


async def test_late_sibling_takes_a_running_requests_prompt_blocks(model_path, ref):
    # Two slots, four responses to one prompt: the first two share a prefill; the later two
    # take the still-running first one's blocks and feed only the prompt's last token. After
    # a weight update the prompt's cache is stale, so a new request runs its prompt again.
    p = prompts([19], seed=16)[0]
    engine = TorchEngine(model_path, max_running=2, eos_token_ids=())
    try:
        lengths = [40, 5, 6, 8]
        results = await asyncio.gather(*(engine.generate(req(f"r{k}", p, n)) for k, n in enumerate(lengths)))
        stats = engine.stats()
        assert stats["prefill_tokens"] == len(p) + 2
        assert stats["shared_prefill_tokens"] == len(p) + 2 * (len(p) - 1)
        for r, n in zip(results, lengths):
            np.testing.assert_array_equal(r.response_ids, hf_greedy(ref, p, n))
            assert np.abs(full_forward_logprobs(ref, p, r.response_ids) - r.logprobs).max() <= 1e-4
        (first,) = await _start(engine, [req("s0", p, 40)], "s0", 3)
        await engine.pause("keep")
        await engine.finish_weight_update(1)
        await engine.resume()
        await engine.generate(req("s1", p, 4))
        await first
        assert engine.stats()["prefill_tokens"] == stats["prefill_tokens"] + 2 * len(p)
    finally:
        await engine.close()


@pytest.mark.parametrize("decoder", ["auto", "hf"])
async def test_both_forwards_equal_generate_with_shared_prompts(model_path, ref, decoder):
    # The lean Llama-layout forward and the model's own, over shared prompts (copy on write of
    # the partly filled block), prompts beside decodes and rows of different lengths.
    ps = prompts([7, 16, 3, 33], seed=15)
    engine = TorchEngine(model_path, max_running=5, eos_token_ids=(), decoder=decoder)
    assert (engine._runner.decoder is not None) == (decoder == "auto")
    try:
        reqs = [req(f"r{i}-{k}", p, 20 + 5 * i) for i, p in enumerate(ps) for k in range(2)]
        results = await asyncio.gather(*(engine.generate(r) for r in reqs))
    finally:
        await engine.close()
    for r, q in zip(results, reqs):
        np.testing.assert_array_equal(r.response_ids, hf_greedy(ref, q.prompt_ids, q.max_tokens))
        assert np.abs(full_forward_logprobs(ref, q.prompt_ids, r.response_ids) - r.logprobs).max() <= 1e-4
    assert engine.stats()["shared_prefill_tokens"] > 0
def test_dtype_by_name_or_auto_and_a_bad_one_named(model_path):
    assert TorchEngineConfig(model_path=model_path, dtype=torch.bfloat16).dtype == "bfloat16"  # kept by name
    with pytest.raises(ValueError, match="dtype must be .*'auto', got 'bf17'"):
        TorchEngineConfig(model_path=model_path, dtype="bf17")
    engine = TorchEngine(model_path, dtype="auto")  # the checkpoint's own: the tiny model is saved in float32
    assert {d for _, d, _ in engine.param_meta()} == {torch.float32}
    half = TorchEngine(model_path, dtype="bfloat16")
    assert {d for _, d, _ in half.param_meta()} == {torch.bfloat16}


@pytest.mark.gpu
async def test_the_launchers_engine_settings_put_the_built_in_engine_on_the_gpu(model_path):
    """`engine.kind=torch` with Rollouter GPUs: the replica runs on CUDA in the configured dtype."""
    from asyncrl.config import load_config

    cfg, _ = load_config([], ["engine.kind=torch", "placement.rollouter_gpus=1", "placement.trainer_gpus=1",
                              "engine.dtype=bfloat16"])
    engine = TorchEngine(**cfg.engine_kwargs(str(model_path)))
    try:
        assert next(engine.model.parameters()).device.type == "cuda"
        assert {d for _, d, _ in engine.param_meta()} == {torch.bfloat16}
        result = await engine.generate(req("g0", prompts([5], seed=3)[0], 8))
        assert len(result.response_ids) >= 1 and np.isfinite(result.logprobs).all()
    finally:
        await engine.close()


@pytest.mark.gpu
async def test_cuda_greedy_and_logprobs_match_transformers(model_path):
    ref_cuda = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to("cuda").eval()
    ps = prompts([3, 9, 14], seed=10)
    engine = TorchEngine(model_path, device="cuda", max_running=2, eos_token_ids=())
    try:
        results = await asyncio.gather(*(engine.generate(req(f"r{i}", p, 24)) for i, p in enumerate(ps)))
    finally:
        await engine.close()
    for p, r in zip(ps, results):
        x = torch.as_tensor(p, device="cuda")[None]
        out = ref_cuda.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False, eos_token_id=None)
        np.testing.assert_array_equal(r.response_ids, out[0, len(p) :].cpu().numpy())
        with torch.no_grad():
            ids = out[:, :]
            logp = torch.log_softmax(ref_cuda(ids).logits[0].float(), -1)
            expected = logp[len(p) - 1 : -1].gather(1, ids[0, len(p) :, None])[:, 0].cpu().numpy()
        assert np.abs(expected - r.logprobs).max() <= 1e-3  # TF32 matmuls on GPU
