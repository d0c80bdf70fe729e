"""Token sampling and behaviour log-probs for the built-in engine.

The log-prob returned for a token is ``log_softmax(logits / T)[token]``: the distribution
after temperature, before top-k/top-p truncation (no renormalisation over the kept set).
Greedy rows use ``T = 1``. With ``top_k=0, top_p=1`` this is exactly vLLM's
``logprobs_mode="processed_logprobs"``; vLLM's default (``raw_logprobs``) is the same
quantity at ``T = 1``. A trainer recomputes it as ``log_softmax(model(x).logits / T)``.

Draws are by inverse CDF, one uniform per row, all rows at once. A request with a seed
takes its ``k``-th token's uniform from a hash of ``(seed, k)`` (counter-based: no generator
per request, and the same tokens whatever else runs in the batch, after a pause, or on
another engine of the same model); the others draw theirs from the engine's generator.

Left out: repetition/frequency penalties, min-p, logit bias (no task here needs them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.rollouter.engines.base import mix64
from asyncrl.types import SamplingParams

def seeded_uniform(seed: int, counter: int) -> float:
    """A uniform in [0, 1) from ``(seed, counter)``: 53 bits of a double mix."""
    return (mix64(mix64(seed) ^ counter) >> 11) * 2.0**-53


def _truncate(scaled_logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k and the top-p nucleus of one row."""
    out = scaled_logp
    if top_k > 0 and top_k < out.numel():
        kth = torch.topk(out, top_k).values[-1]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_lp, order = torch.sort(out, descending=True)
        probs = sorted_lp.softmax(-1)
        # Keep a token if the mass before it is < top_p (so the top token is always kept).
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    counters: Sequence[int],
    default_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [N, V]; return ``(token_ids [N], logprobs [N])``.

    ``counters[i]`` is the index of the token row ``i`` samples (its tokens generated so far):
    with the row's seed it fixes the row's uniform.
    """
    logits = logits.float()
    temps = [1.0 if p.greedy else p.temperature for p in params]
    if all(t == 1.0 for t in temps):  # x / 1.0 == x exactly: skip building and applying the divisor
        logp = torch.log_softmax(logits, dim=-1)
    else:
        logp = torch.log_softmax(logits / torch.tensor(temps, device=logits.device)[:, None], dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        scaled = logp[sampled]  # a copy: the returned log-probs are before truncation
        for j, i in enumerate(sampled):  # truncation is per row, and rare
            p = params[i]
            if p.top_k > 0 or p.top_p < 1.0:
                scaled[j] = _truncate(scaled[j], p.top_k, p.top_p)
        probs = scaled.double().exp()
        cdf = probs.cumsum(-1)
        n_unseeded = sum(params[i].seed is None for i in sampled)
        drawn_u = iter(torch.rand(n_unseeded, generator=default_generator, dtype=torch.float64).tolist())
        u = torch.tensor([next(drawn_u) if params[i].seed is None else seeded_uniform(params[i].seed, counters[i])
                          for i in sampled], dtype=torch.float64, device=logits.device)
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_max(cdf.shape[1] - 1)
        # A rounding edge could land on a token of zero probability: take the row's top token then.
        drawn = torch.where(probs.gather(1, drawn[:, None])[:, 0] > 0, drawn, probs.argmax(-1))
        tokens[torch.tensor(sampled, device=logits.device)] = drawn
    return tokens, logp.gather(1, tokens[:, None]).view(-1)
