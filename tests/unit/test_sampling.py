"""The engine's sampler: draws follow the distribution, seeds fix tokens, truncation, log-probs."""

from __future__ import annotations

import torch

from asyncrl.rollouter.engines.builtin.sampling import sample_tokens, seeded_uniform
from asyncrl.types import SamplingParams


def test_seeded_uniforms_are_uniform_and_fixed_by_seed_and_counter():
    u = torch.tensor([seeded_uniform(s, c) for s in range(200) for c in range(50)], dtype=torch.float64)
    assert 0 <= u.min() and u.max() < 1
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts - 1000).abs().max() < 150  # 10,000 draws, ~32 standard deviation = 1 bin's noise
    assert seeded_uniform(7, 3) == seeded_uniform(7, 3) != seeded_uniform(7, 4) != seeded_uniform(8, 3)


def test_draws_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = [SamplingParams(temperature=0.7, seed=s) for s in range(4000)]
    tokens, logprobs = sample_tokens(logits.expand(4000, 4), params, [0] * 4000, torch.Generator())
    expected = torch.softmax(logits[0] / 0.7, -1)
    freq = torch.bincount(tokens, minlength=4) / 4000
    assert (freq - expected).abs().max() < 0.03
    torch.testing.assert_close(logprobs, expected.log()[tokens])


def test_seeded_rows_do_not_depend_on_their_neighbours():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    params = [SamplingParams(temperature=1.0, seed=11), SamplingParams(greedy=True), SamplingParams(temperature=1.0)] * 2
    both, _ = sample_tokens(logits, params, [5] * 6, torch.Generator())
    alone, _ = sample_tokens(logits[:1], params[:1], [5], torch.Generator())
    assert both[0] == both[3] == alone[0]  # same seed and counter, same logits: same token
    assert both[1] == logits[1].argmax()


def test_top_k_and_top_p_draw_inside_the_kept_set_and_log_probs_are_before_truncation():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0, -1.0]]).expand(500, 5)
    for params, allowed in ((SamplingParams(top_k=2), {0, 1}), (SamplingParams(top_p=0.5), {0, 1})):
        rows = [SamplingParams(top_k=params.top_k, top_p=params.top_p, seed=s) for s in range(500)]
        tokens, logprobs = sample_tokens(logits, rows, [0] * 500, torch.Generator())
        assert set(tokens.tolist()) == allowed
        torch.testing.assert_close(logprobs, torch.log_softmax(logits[0], -1)[tokens])
