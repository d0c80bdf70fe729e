"""GRPO advantages and the PPO-style policy loss with off-policy correction.

Implements:

- GRPO group-normalised advantages (optionally without the std division, as in Dr. GRPO);
- per-token log-probs and entropy from logits, aligned so that position ``t`` holds the
  log-prob of token ``t`` (the logits at ``t - 1`` predict it);
- the PPO clipped objective against the behaviour log-probs the engine sent, or, with
  ``decoupled``, against proximal log-probs recomputed with the current weights before the
  update (Hilton et al., 2022), corrected by a truncated importance weight;
- truncated importance sampling (TIS) for stale tokens, and an optional k3 KL penalty to a
  frozen reference;
- loss aggregation ``token-mean``, ``seq-mean-token-mean``, ``seq-mean-token-sum`` with an
  explicit denominator, so that a mini-batch split over micro-batches and ranks gives the
  loss of the whole mini-batch.

Leaves out: value functions/GAE (GRPO needs none), entropy bonus, and reward shaping (the
Rollouter's reward function owns rewards). Batches use the keys of `asyncrl.trainer.batch`.
"""

from __future__ import annotations

import torch

from asyncrl.trainer.config import AlgorithmConfig

#: Log-ratios are clamped to this before ``exp`` so one wild token cannot overflow the loss.
_MAX_LOG_RATIO = 20.0


def grpo_advantages(rewards: torch.Tensor, norm_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantages of ``rewards`` [groups, n]: centred per group, optionally divided by its std.

    The group mean is the baseline: a response is good only relative to its siblings for the
    same prompt, which removes the need for a learned critic.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, n], got shape {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not norm_by_std:
        return centred
    # Unbiased std like GRPO; a group with identical rewards has std 0 and gets advantage 0
    # (eps keeps the division finite). n == 1 has no spread at all: advantage 0.
    std = rewards.std(dim=1, keepdim=True, unbiased=True) if rewards.shape[1] > 1 else torch.zeros_like(centred)
    return centred / (std + eps)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of every token of ``input_ids`` [B, L] under ``logits`` [B, L, V]; position 0 gets 0.

    The logits at position ``t - 1`` predict token ``t``: that shift is the whole point of this
    function, and the test against the engine's behaviour log-probs guards it.
    """
    scaled = logits[:, :-1].float() / temperature
    picked = torch.gather(scaled, -1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    shifted = picked - torch.logsumexp(scaled, dim=-1)
    return torch.nn.functional.pad(shifted, (1, 0), value=0.0)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the distribution that sampled each token, aligned like `token_logprobs`."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(ent, (1, 0), value=0.0)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, denom: float) -> torch.Tensor:
    """Sum masked per-token ``values`` [B, L] into one scalar divided by ``denom``.

    ``denom`` is the mini-batch's total: response tokens for ``token-mean``, sequences for the
    ``seq-mean-*`` modes. Dividing by the whole mini-batch's count (not the micro-batch's) makes
    the gradients accumulated over micro-batches and ranks equal those of one big batch.
    """
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        # Every response token weighs the same: long answers dominate, as in DAPO.
        return (values * mask).sum() / denom
    per_seq_sum = (values * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        # Each sequence contributes its summed loss (Dr. GRPO's unnormalised length).
        return per_seq_sum.sum() / denom
    if mode == "seq-mean-token-mean":
        # Each sequence weighs the same regardless of length (the original GRPO).
        return (per_seq_sum / mask.sum(-1).clamp(min=1)).sum() / denom
    raise ValueError(f"loss_agg_mode {mode!r} is not one of token-mean, seq-mean-token-mean, seq-mean-token-sum")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: AlgorithmConfig,
    *,
    denom: float,
    proximal_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy loss of one micro-batch (all tensors [B, L]) and its token statistics.

    ``old_logprobs`` are the behaviour log-probs from the engine. With ``cfg.decoupled`` the
    ratio is taken against ``proximal_logprobs`` instead. Statistics are sums over masked
    tokens (plus ``max``/``min``) so callers can combine micro-batches and ranks exactly.
    """
    if cfg.decoupled and proximal_logprobs is None:
        raise ValueError("decoupled PPO needs proximal_logprobs recomputed before the update")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs from the frozen reference")
    m = mask.bool()
    # Tokens off the mask (padding, prompt, a conversation's observations) must not matter at
    # all: zero what the batch carries there, so that no value (even inf or NaN) can reach the
    # loss or, through 0 * inf in the backward pass, the gradients.
    old_logprobs, advantages = old_logprobs.where(m, 0.0), advantages.where(m, 0.0)
    if proximal_logprobs is not None:
        proximal_logprobs = proximal_logprobs.where(m, 0.0)
    if ref_logprobs is not None:
        ref_logprobs = ref_logprobs.where(m, 0.0)
    anchor = proximal_logprobs if cfg.decoupled else old_logprobs
    # The ratio pi_theta / pi_anchor re-weights samples drawn from pi_anchor toward the current
    # policy; clamping the log keeps exp finite on tokens that drifted far.
    ratio = torch.exp((logprobs - anchor).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    # PPO's clip stops the update from pushing the ratio out of [1 - low, 1 + high]: beyond it
    # the pessimistic (max) branch is the constant clipped one, whose gradient is zero.
    clipped = -advantages * ratio.clamp(1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high)
    per_token = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped) & m
    truncated = torch.zeros_like(m)
    if cfg.decoupled:
        # Decoupled PPO: the proximal policy anchors the trust region; the off-policy gap between
        # the behaviour policy (which sampled the token) and the proximal one is corrected by an
        # importance weight, truncated at tis_cap so very stale tokens cannot dominate (TIS).
        weight = torch.exp((proximal_logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        if cfg.tis_cap is not None:
            truncated = (weight > cfg.tis_cap) & m
            weight = weight.clamp(max=cfg.tis_cap)
        per_token = per_token * weight.detach()
    elif cfg.tis_cap is not None:
        # Without a proximal policy the ratio to the behaviour policy is itself the importance
        # weight. For a negative advantage PPO's max keeps it unbounded; capping it at tis_cap
        # (dual clip) bounds the weight a stale token gets. Positive advantages are bounded by the clip.
        capped = -advantages * cfg.tis_cap
        truncated = (advantages < 0) & (per_token > capped) & m
        per_token = torch.where(advantages < 0, torch.minimum(per_token, capped), per_token)
    kl = torch.zeros_like(per_token)
    if cfg.kl_coef > 0:
        # k3 estimator of KL(pi_theta || pi_ref): unbiased, always >= 0 and low-variance
        # (Schulman, 2020); it keeps the policy near the reference without a reward penalty.
        log_r = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl = torch.exp(log_r) - log_r - 1
        per_token = per_token + cfg.kl_coef * kl
    loss = aggregate(per_token, mask, cfg.loss_agg_mode, denom)
    behaviour_ratio = torch.exp((logprobs - old_logprobs).detach().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    big = torch.finfo(behaviour_ratio.dtype).max
    stats = {
        "tokens": m.sum(),
        "clipped_tokens": was_clipped.sum(),
        "truncated_tokens": truncated.sum(),
        "is_ratio_sum": (behaviour_ratio * m).sum(),
        "is_ratio_max": torch.where(m, behaviour_ratio, -big).max(),
        "is_ratio_min": torch.where(m, behaviour_ratio, big).min(),
        "kl_sum": (kl.detach() * m).sum(),
    }
    return loss, stats
