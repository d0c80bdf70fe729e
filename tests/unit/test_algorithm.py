"""Loss math against hand-computed values: GRPO advantages, log-prob alignment, PPO clip, TIS
(dual clip and decoupled), KL, and every aggregation mode with masked padding."""

import math

import pytest
import torch

from asyncrl.trainer.algorithm import aggregate, grpo_advantages, policy_loss, token_entropy, token_logprobs
from asyncrl.trainer.config import AlgorithmConfig, OptimConfig, TrainerConfig, WorkerConfig
from asyncrl.trainer.worker import lr_at


def test_grpo_advantages_std_and_no_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3)
    adv = grpo_advantages(rewards, norm_by_std=True)
    expect = 0.5 / math.sqrt(1 / 3)
    assert torch.allclose(adv[0], torch.tensor([expect, -expect, -expect, expect]), atol=1e-5)
    assert torch.equal(adv[1], torch.zeros(4))  # identical rewards carry no signal
    adv = grpo_advantages(rewards, norm_by_std=False)
    assert torch.equal(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match="groups, n"):
        grpo_advantages(torch.zeros(4))


def test_token_logprobs_are_shifted_by_one():
    # logits at position t predict token t+1: make position 0 predict token 2 strongly.
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = 3.0
    logits[0, 1, 1] = 1.0
    ids = torch.tensor([[0, 2, 1]])
    lp = token_logprobs(logits, ids)
    assert lp[0, 0] == 0.0
    assert lp[0, 1] == pytest.approx(3.0 - math.log(math.exp(3.0) + 3), abs=1e-6)
    assert lp[0, 2] == pytest.approx(1.0 - math.log(math.e + 3), abs=1e-6)
    # Temperature divides the logits first.
    lp_t = token_logprobs(logits, ids, temperature=2.0)
    assert lp_t[0, 1] == pytest.approx(1.5 - math.log(math.exp(1.5) + 3), abs=1e-6)
    # Entropy is aligned the same way: position 2 holds the entropy of the logits at position 1.
    ent = token_entropy(logits)
    z = math.e + 3
    probs = [1 / z, math.e / z, 1 / z, 1 / z]
    assert ent[0, 0] == 0.0 and ent[0, 2] == pytest.approx(-sum(p * math.log(p) for p in probs), abs=1e-6)


def _cfg(**kw):
    base = dict(tis_cap=None, clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean")
    return AlgorithmConfig(**{**base, **kw})


def _loss(logp, old, adv, mask, cfg, **kw):
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    lp = t(logp).requires_grad_(True)
    loss, stats = policy_loss(lp, t(old), t(adv), t(mask), cfg, denom=kw.pop("denom", float(sum(map(sum, mask)))),
                              **{k: t(v) for k, v in kw.items()})
    return loss, stats, lp


def test_ppo_clip_positive_and_negative_advantage():
    r_hi, r_lo = math.log(1.5), math.log(0.5)
    # token 0: A=+1, ratio 1.5 -> clipped to 1.2 -> loss -1.2 (no gradient)
    # token 1: A=-1, ratio 0.5 -> clipped to 0.8 -> loss +0.8 (no gradient)
    # token 2: A=+1, ratio 1.0 -> loss -1.0, gradient -1 * ratio = -1
    loss, stats, lp = _loss([[r_hi, r_lo, 0.0]], [[0.0, 0.0, 0.0]], [[1.0, -1.0, 1.0]], [[1, 1, 1]], _cfg())
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.0) / 3, abs=1e-6)
    assert stats["clipped_tokens"].item() == 2
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, 0.0, -1.0 / 3]]), atol=1e-6)
    assert stats["is_ratio_max"].item() == pytest.approx(1.5, abs=1e-6)
    assert stats["is_ratio_min"].item() == pytest.approx(0.5, abs=1e-6)


def test_tis_without_decoupled_caps_negative_advantage_weight():
    # A=-1, ratio 3: PPO gives max(3, 0.8*..)=3; the cap at 2 bounds it to 2 (dual clip).
    loss, stats, _ = _loss([[math.log(3.0)]], [[0.0]], [[-1.0]], [[1]], _cfg(tis_cap=2.0))
    assert loss.item() == pytest.approx(2.0, abs=1e-6)
    assert stats["truncated_tokens"].item() == 1
    loss, stats, _ = _loss([[math.log(3.0)]], [[0.0]], [[-1.0]], [[1]], _cfg(tis_cap=None))
    assert loss.item() == pytest.approx(3.0, abs=1e-5)
    # A positive advantage is bounded by the clip already; TIS leaves it alone.
    loss, stats, _ = _loss([[math.log(3.0)]], [[0.0]], [[1.0]], [[1]], _cfg(tis_cap=2.0))
    assert loss.item() == pytest.approx(-1.2, abs=1e-6) and stats["truncated_tokens"].item() == 0


def test_decoupled_ratio_against_proximal_with_truncated_weight():
    # behaviour 0, proximal log(3) (weight 3 -> capped 2), current = proximal * 1.1
    prox = math.log(3.0)
    logp = prox + math.log(1.1)
    cfg = _cfg(decoupled=True, tis_cap=2.0)
    loss, stats, lp = _loss([[logp]], [[0.0]], [[1.0]], [[1]], cfg, proximal_logprobs=[[prox]])
    assert loss.item() == pytest.approx(-1.1 * 2.0, abs=1e-5)  # ratio 1.1 inside the clip, weight 2
    assert stats["truncated_tokens"].item() == 1
    loss.backward()
    assert lp.grad.item() == pytest.approx(-1.1 * 2.0, abs=1e-5)  # d/dlogp of -A*w*ratio
    # Without the cap the full weight 3 applies.
    loss, _, _ = _loss([[logp]], [[0.0]], [[1.0]], [[1]], _cfg(decoupled=True, tis_cap=None),
                       proximal_logprobs=[[prox]])
    assert loss.item() == pytest.approx(-1.1 * 3.0, abs=1e-5)
    with pytest.raises(ValueError, match="proximal"):
        _loss([[0.0]], [[0.0]], [[1.0]], [[1]], cfg)


def test_kl_penalty_k3():
    # ref - logp = d; k3 = e^d - d - 1. With A=0 the PPO term vanishes.
    d = 0.5
    cfg = _cfg(kl_coef=0.1)
    loss, stats, _ = _loss([[0.0, 0.0]], [[0.0, 0.0]], [[0.0, 0.0]], [[1, 1]], cfg, ref_logprobs=[[d, 0.0]])
    k3 = math.exp(d) - d - 1
    assert loss.item() == pytest.approx(0.1 * k3 / 2, abs=1e-6)
    assert stats["kl_sum"].item() == pytest.approx(k3, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        _loss([[0.0]], [[0.0]], [[0.0]], [[1]], cfg)


@pytest.mark.parametrize(
    "mode, expected",
    [
        # values row0 = [1, 2, pad], row1 = [4, pad, pad]; 3 real tokens, 2 sequences
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-mean", ((1 + 2) / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum", ((1 + 2) + 4) / 2),
    ],
)
def test_aggregation_modes_ignore_padding(mode, expected):
    values = torch.tensor([[1.0, 2.0, 1e6], [4.0, -1e6, 7e5]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    denom = 3.0 if mode == "token-mean" else 2.0
    assert aggregate(values, mask, mode, denom).item() == pytest.approx(expected, abs=1e-6)


def test_padding_gets_no_gradient_and_no_loss():
    # The padded token has a huge advantage and ratio; neither may reach the loss or gradient.
    loss, stats, lp = _loss([[0.0, 5.0]], [[0.0, 0.0]], [[1.0, 1e4]], [[1, 0]], _cfg(tis_cap=2.0), denom=1.0)
    assert loss.item() == pytest.approx(-1.0, abs=1e-6)
    loss.backward()
    assert lp.grad[0, 1].item() == 0.0
    assert stats["tokens"].item() == 1 and stats["is_ratio_max"].item() == pytest.approx(1.0)


def test_split_denominator_equals_whole_batch():
    # Summing micro-batch losses normalised by the global count equals the whole batch's loss.
    cfg = _cfg(loss_agg_mode="seq-mean-token-mean")
    logp = [[0.1, -0.2, 0.0], [0.3, 0.0, 0.0]]
    old = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    adv = [[1.0, 1.0, 0.0], [-1.0, 0.0, 0.0]]
    mask = [[1, 1, 0], [1, 0, 0]]
    whole, _, _ = _loss(logp, old, adv, mask, cfg, denom=2.0)
    a, _, _ = _loss(logp[:1], old[:1], adv[:1], mask[:1], cfg, denom=2.0)
    b, _, _ = _loss(logp[1:], old[1:], adv[1:], mask[1:], cfg, denom=2.0)
    assert (a + b).item() == pytest.approx(whole.item(), abs=1e-7)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="tis_cap"):
        AlgorithmConfig(tis_cap=0.5)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        AlgorithmConfig(loss_agg_mode="sum")
    with pytest.raises(ValueError, match="clip_ratio_low"):
        AlgorithmConfig(clip_ratio_low=1.0)


def test_lr_warmup_then_cosine():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine", total_steps=14, min_lr_ratio=0.1)
    assert [lr_at(cfg, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(cfg, 4) == pytest.approx(1.0)
    assert lr_at(cfg, 9) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway down the cosine
    assert lr_at(cfg, 14) == pytest.approx(0.1) and lr_at(cfg, 100) == pytest.approx(0.1)
    assert lr_at(OptimConfig(lr=0.3), 50) == 0.3
    with pytest.raises(ValueError, match="total_steps"):
        OptimConfig(schedule="cosine", warmup_steps=5, total_steps=5)


def test_trainer_config_errors_name_the_field():
    worker = WorkerConfig(model_path="/tmp/m")
    with pytest.raises(ValueError, match="on_incomplete_group"):
        TrainerConfig(worker=worker, on_incomplete_group="skip")
    with pytest.raises(ValueError, match="trigger_parameter_sync_step"):
        TrainerConfig(worker=worker, trigger_parameter_sync_step=0)
    with pytest.raises(ValueError, match="max_version_gap"):
        TrainerConfig(worker=worker, max_version_gap=-1)
    with pytest.raises(ValueError, match="model_path"):
        WorkerConfig(model_path="")
