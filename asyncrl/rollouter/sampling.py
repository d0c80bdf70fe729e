"""Token sampling and behaviour log-probs for the built-in engine.

The log-prob returned for a token is ``log_softmax(logits / T)[token]``: the distribution
after temperature, before top-k/top-p truncation (no renormalisation over the kept set).
Greedy rows use ``T = 1``. With ``top_k=0, top_p=1`` this is exactly vLLM's
``logprobs_mode="processed_logprobs"``; vLLM's default (``raw_logprobs``) is the same
quantity at ``T = 1``. A trainer recomputes it as ``log_softmax(model(x).logits / T)``.

Left out: repetition/frequency penalties, min-p, logit bias (no task here needs them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.types import SamplingParams


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
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [N, V]; return ``(token_ids [N], logprobs [N])``.

    ``generators[i]`` is the row's own generator (a request with a seed) or None, in which
    case ``default_generator`` draws it (one batched draw for all such rows).
    """
    logits = logits.float()
    temps = torch.tensor(
        [1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32, device=logits.device
    )
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)
    # Greedy rows: one batched argmax (the common case needs no per-row Python work).
    tokens = torch.argmax(logits, dim=-1)
    shared_rows, shared_probs = [], []
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = _truncate(logp[i], p.top_k, p.top_p).softmax(-1)
        if generators[i] is None:
            shared_rows.append(i)
            shared_probs.append(probs)
        else:
            tokens[i] = _draw(probs[None], generators[i])[0]
    if shared_rows:
        drawn = _draw(torch.stack(shared_probs), default_generator)
        tokens[torch.tensor(shared_rows, device=logits.device)] = drawn
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def _draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    # Generators live on the CPU so seeded draws do not depend on the device.
    return torch.multinomial(probs.cpu(), 1, generator=generator)[:, 0].to(probs.device)
