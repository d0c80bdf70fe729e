"""A multi-turn trajectory's loss mask, from the record to the loss.

Observation tokens (``loss_mask`` 0) are read by the model but never trained: whatever the
record carries there (log-probs, versions) and whatever the batch carries there (advantages,
old log-probs, even inf/NaN) must change neither the loss nor any gradient; token counts and
staleness skip them. Runs the real batch assembly and loss on a small torch model.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from asyncrl.skip.rollout_skip import REPLAY_KEY, rebase_versions
from asyncrl.trainer import algorithm
from asyncrl.trainer.batch import assemble, oldest_version, screen_groups
from asyncrl.trainer.config import AlgorithmConfig
from asyncrl.trainer.trainer import _partial_metrics
from asyncrl.turns import to_trajectory
from asyncrl.types import Group, Trajectory

VOCAB = 32
MASK = np.array([1, 1, 1, 0, 0, 0, 0, 1, 1, 1], np.uint8)  # turn, observation, turn
SID = "sample_0_4"


def conversation(k: int, *, masked: bool = True, garbage: bool = False, version: int = 3) -> Trajectory:
    """Response ``k`` of the group: ten tokens, the middle four an observation when ``masked``."""
    rng = np.random.default_rng(k)
    response = rng.integers(0, VOCAB, len(MASK))
    logprobs = -rng.random(len(MASK)).astype(np.float32)
    versions = np.full(len(MASK), version, np.int64)
    observation = MASK == 0
    logprobs[observation], versions[observation] = 0.0, -1
    if garbage:  # what a buggy loop might leave on observation tokens: it must not matter
        logprobs[observation] = [1e6, np.nan, -np.inf, 7.0]
        versions[observation] = [-50, 999, -1, 0]
    return Trajectory(SID, k, rng.integers(0, VOCAB, 3), response, logprobs, versions,
                      "max_turns" if k else "stop", reward=float(k), loss_mask=MASK if masked else None,
                      turns=2 if masked else 1)


def conversations(**kw) -> Group:
    return Group(SID, [conversation(k, **kw) for k in range(3)], expected=3)


class TinyLM(torch.nn.Module):
    """Embedding + one mixing layer + head: real logits whose gradients depend on every token."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        h = torch.tanh(self.mix(h.cumsum(1)))  # each position sees its prefix, observations included
        return self.head(h)


CONFIGS = {
    "token-mean, dual-clip tis": AlgorithmConfig(tis_cap=2.0),
    "seq-mean-token-mean": AlgorithmConfig(loss_agg_mode="seq-mean-token-mean", tis_cap=None),
    "seq-mean-token-sum, kl": AlgorithmConfig(loss_agg_mode="seq-mean-token-sum", kl_coef=0.1),
    "decoupled": AlgorithmConfig(decoupled=True, tis_cap=1.5),
}


def loss_and_grads(batch, cfg: AlgorithmConfig, *, edit=None):
    """The real policy loss of ``batch`` under `TinyLM`, and its parameters' gradients."""
    model = TinyLM()
    logprobs = algorithm.token_logprobs(model(batch["input_ids"]), batch["input_ids"])
    with torch.no_grad():
        near = logprobs.detach() + 0.05  # stands in for the proximal / reference policies
    inputs = {"old_logprobs": batch["old_logprobs"].clone(), "advantages": batch["advantages"].clone(),
              "proximal_logprobs": near.clone(), "ref_logprobs": (near - 0.1).clone()}
    if edit is not None:
        edit(inputs, batch["response_mask"] == 0)
    mode_denom = batch["response_mask"].sum() if cfg.loss_agg_mode == "token-mean" else batch.batch_size[0]
    loss, stats = algorithm.policy_loss(
        logprobs, inputs["old_logprobs"], inputs["advantages"], batch["response_mask"], cfg, denom=float(mode_denom),
        proximal_logprobs=inputs["proximal_logprobs"] if cfg.decoupled else None,
        ref_logprobs=inputs["ref_logprobs"] if cfg.kl_coef > 0 else None)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], stats


def test_the_batch_masks_observation_tokens_out_of_the_loss():
    batch = assemble([conversations()])
    p = 3  # prompt tokens
    row = batch["response_mask"][0]
    assert row[:p].tolist() == [0, 0, 0] and row[p:p + len(MASK)].tolist() == MASK.tolist()
    assert batch["attention_mask"][0].sum() == p + len(MASK)  # the model still reads the observation
    observation = p + np.flatnonzero(MASK == 0)
    assert batch["advantages"][2, observation].eq(0).all() and batch["advantages"][2, p].ne(0)
    assert batch["versions"][0, observation].eq(-1).all() and batch["old_logprobs"][0, observation].eq(0).all()
    assert int(batch["response_mask"].sum()) == 3 * int(MASK.sum())  # model tokens only


@pytest.mark.parametrize("name", list(CONFIGS))
def test_garbage_on_observation_tokens_changes_neither_loss_nor_gradients(name):
    cfg = CONFIGS[name]
    clean = assemble([conversations()])
    loss, grads, stats = loss_and_grads(clean, cfg)
    # Garbage in the records (log-probs, versions) on observation tokens ...
    dirty_loss, dirty_grads, dirty_stats = loss_and_grads(assemble([conversations(garbage=True)]), cfg)
    # ... and in the batch tensors themselves (what a later stage might write there).

    def scribble(inputs, off):
        for key, value in (("old_logprobs", float("nan")), ("advantages", float("inf")),
                           ("proximal_logprobs", 1e9), ("ref_logprobs", float("-inf"))):
            inputs[key][off] = value

    scribbled_loss, scribbled_grads, scribbled_stats = loss_and_grads(clean, cfg, edit=scribble)
    for other_loss, other_grads, other_stats in ((dirty_loss, dirty_grads, dirty_stats),
                                                 (scribbled_loss, scribbled_grads, scribbled_stats)):
        assert torch.isfinite(loss) and torch.equal(other_loss, loss)
        assert all(torch.equal(a, b) for a, b in zip(other_grads, grads))
        assert {k: float(v) for k, v in other_stats.items()} == {k: float(v) for k, v in stats.items()}
    assert int(stats["tokens"]) == 3 * int(MASK.sum())  # token counts are model tokens
    # The mask matters: the same tokens all trained give another loss and other gradients.
    unmasked_loss, unmasked_grads, unmasked_stats = loss_and_grads(assemble([conversations(masked=False)]), cfg)
    assert not torch.equal(unmasked_loss, loss) or not all(torch.equal(a, b) for a, b in zip(unmasked_grads, grads))
    assert int(unmasked_stats["tokens"]) == 3 * len(MASK)


def test_observation_versions_are_not_staleness():
    g = conversations(version=5)
    assert oldest_version(g) == 5
    kept, dropped = screen_groups([g], max_version_gap=0, current_version=5)
    assert kept == [g] and dropped == []  # -1 on observations would be a gap of 6
    assert _partial_metrics([g])["fully_async/partial/max_partial_span"] == 0.0
    stale, dropped = screen_groups([conversations(version=3)], max_version_gap=1, current_version=5)
    assert stale == [] and "oldest token version 3" in dropped[0][1]


def test_a_replayed_conversation_rebases_only_model_tokens_and_keeps_its_mask():
    g = conversations(version=2)
    g = Group(SID, g.trajectories, expected=3, meta={REPLAY_KEY: {"role": "async_rollout"}})
    out = rebase_versions(g, 9).trajectories[0]
    assert out.versions[MASK == 1].tolist() == [9] * int(MASK.sum())
    assert (out.versions[MASK == 0] == -1).all() and np.array_equal(out.loss_mask, MASK) and out.turns == 2


def test_trajectory_refuses_a_mask_that_does_not_fit_naming_the_sample():
    t = conversation(1)
    with pytest.raises(ValueError, match=r"sample_0_4\[1\]: loss_mask must have one entry per response token \(10\)"):
        dataclasses.replace(t, loss_mask=MASK[:-1])
    with pytest.raises(ValueError, match=r"sample_0_4\[1\]: loss_mask must hold only 0 and 1"):
        dataclasses.replace(t, loss_mask=MASK * 2)
    with pytest.raises(TypeError, match=r"sample_0_4\[1\]: loss_mask must be bool or integer"):
        dataclasses.replace(t, loss_mask=MASK.astype(np.float32))
    with pytest.raises(ValueError, match=r"sample_0_4\[1\]: turns must be an int >= 0"):
        dataclasses.replace(t, turns=-1)
    assert dataclasses.replace(t, loss_mask=MASK.astype(bool)).loss_mask.dtype == np.uint8


def test_max_turns_and_context_are_finished_episodes_the_trainer_learns_from():
    g = Group(SID, [dataclasses.replace(conversation(k), finish_reason=f) for k, f in
                    enumerate(("max_turns", "context", "stop"))], expected=3)
    assert g.complete and g.missing() == ""


@dataclasses.dataclass
class Episode:  # shaped like asyncrl.agent.AgentTrajectory
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: str
    reward: float | None
    turns: int


def test_to_trajectory_keeps_the_episode_and_drops_an_all_ones_mask():
    from asyncrl.agent.base import AgentTrajectory

    t = conversation(1)
    episode = AgentTrajectory(t.prompt_ids, t.response_ids, MASK, t.logprobs, t.versions, "max_turns",
                              reward=None, turns=2)
    out = to_trajectory(episode, sample_id=SID, index=1, reward=0.5)
    assert out == dataclasses.replace(t, reward=0.5)
    single = Episode(t.prompt_ids, t.response_ids, np.ones(len(MASK), np.uint8), t.logprobs, t.versions, "stop",
                     1.0, 1)
    plain = to_trajectory(single, sample_id=SID, index=0, reward=0.0)
    assert plain.loss_mask is None and plain.turns == 1 and plain.reward == 1.0  # the env's reward wins
    with pytest.raises(ValueError, match=r"sample_0_4\[2\]: the episode has no reward"):
        to_trajectory(dataclasses.replace(single, reward=None), sample_id=SID, index=2)


def test_the_samples_audit_records_turns_and_masked_tokens_per_trajectory(tmp_path):
    from asyncrl.trainer import audit

    g = Group(SID, [conversation(2), conversation(0, masked=False), conversation(1)], expected=3)
    plain = Group("sample_0_5", [dataclasses.replace(conversation(k, masked=False), sample_id="sample_0_5")
                                 for k in range(2)], expected=2)
    log = audit.SampleLog(tmp_path / "samples.jsonl")
    log.append(audit.trained([g, plain], 7) + [audit.dropped(g, 8, "stale: ...")])
    first, second, third = log.read()
    assert first == {"sample_id": SID, "step": 7, "status": "trained", "reason": None,
                     "turns": [1, 2, 2], "masked_tokens": [0, 4, 4]}  # in index order
    assert second["turns"] == [1, 1] and second["masked_tokens"] == [0, 0]
    assert third["status"] == "dropped" and third["masked_tokens"] == [0, 4, 4]
