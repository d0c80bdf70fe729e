"""Batch assembly: complete `Group`s in, one TensorDict with fixed keys out; fail closed.

Only complete groups (status ``ok``, ``expected`` distinct trajectories, each finished by the
model) may reach the loss. `screen_groups` applies the policy: an incomplete group raises
`IncompleteGroupError` naming every offending ``sample_id`` and what it lacks, or, with
``on_incomplete="drop"``, is returned as dropped with its reason so the caller counts and acks
it. Groups older than ``max_version_gap`` are dropped the same way, and so are groups the
Rollouter's ``rollout.group_filter`` marked (`FILTERED_KEY`; reason ``filtered``, before any other
check: they are never trained, whatever they hold), and so are groups dropped for an error of
the user's code (`USER_ERROR_KEY`, ``rollout.on_user_error=drop``; reason ``user_error: <the
error>``). `assemble` refuses any
incomplete group again (it never returns a partial batch) and builds a right-padded batch:

==================  ======  =====================================================
key                 shape   meaning
==================  ======  =====================================================
``input_ids``       [B, L]  prompt + response, padded with ``pad_token_id``
``attention_mask``  [B, L]  1 on real tokens
``response_mask``   [B, L]  1 on response tokens the model wrote and the loss sees (see below)
``position_ids``    [B, L]  0.. over real tokens
``old_logprobs``    [B, L]  behaviour log-prob of token t at position t (0 off the mask)
``versions``        [B, L]  policy version that produced token t (-1 where no policy wrote one)
``advantages``      [B, L]  its episode's GRPO advantage (`episode_advantages`) on masked-in tokens
``rewards``         [B]     scalar reward of the sequence
``group_index``     [B]     which group of the batch the row came from
==================  ======  =====================================================

Rows are grouped: a group's trajectories are adjacent, ordered by trajectory index.

A multi-turn trajectory's observation tokens (``Trajectory.loss_mask`` 0: tool output, env
replies, template markers) are real tokens the model reads (``attention_mask`` 1) but no policy
wrote them: ``response_mask`` is 0 there, so the loss, the advantages, entropy, KL, clip and
importance-ratio statistics and every token count skip them, and their version (-1) never
counts as staleness (`oldest_version`, the ``max_version_gap`` drop).

With ``stop_token_id`` (engines told not to stop at EOS: the long-tail benchmark workload) a
response's tokens after its first stop token stay in the batch, so a step costs the same, but
leave the loss: no reward reads them, and trained they are noise that grows with the budget and
that on-policy steps (ratio 1, PPO's clip idle) take in full (``docs/bench_e2e.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tensordict import TensorDict

from asyncrl.trainer.algorithm import grpo_advantages
from asyncrl.types import FILTERED_KEY, Group, episode_of
from asyncrl.usercode import USER_ERROR_KEY

BATCH_KEYS: tuple[str, ...] = (
    "input_ids", "attention_mask", "response_mask", "position_ids", "old_logprobs", "versions",
    "advantages", "rewards", "group_index",
)


class IncompleteGroupError(RuntimeError):
    """A group that is failed or short reached batch assembly; the run fails closed."""

    def __init__(self, problems: dict[str, str]):
        self.sample_ids = sorted(problems)
        detail = "; ".join(f"{sid}: {why}" for sid, why in sorted(problems.items()))
        super().__init__(
            f"refusing to train on incomplete group(s) {self.sample_ids} ({detail}); "
            "set trainer on_incomplete_group='drop' to drop, count and ack them instead"
        )


def oldest_version(group: Group) -> int | None:
    """The smallest policy version of any model-written token in ``group`` (None if it has none):
    observation tokens (version -1, masked out of the loss) are not stale, only unwritten."""
    mins = [int(v.min()) for v in (t.model_versions for t in group.trajectories) if len(v)]
    return min(mins) if mins else None


FILTERED = "filtered"
"""The drop reason of a group the Rollouter's group filter dropped."""
USER_ERROR = "user_error"
"""The start of the drop reason of a group dropped for an error of the user's code."""


def screen_groups(
    groups: Sequence[Group],
    *,
    on_incomplete: str = "raise",
    max_version_gap: int | None = None,
    current_version: int = 0,
) -> tuple[list[Group], list[tuple[str, str]]]:
    """Split ``groups`` into ``(kept, dropped)``; ``dropped`` holds ``(sample_id, reason)``.

    Raises `IncompleteGroupError` on any incomplete group when ``on_incomplete == "raise"``.
    """
    if on_incomplete not in ("raise", "drop"):
        raise ValueError(f"on_incomplete must be 'raise' or 'drop', got {on_incomplete!r}")
    filtered = {g.sample_id for g in groups if FILTERED_KEY in g.meta}
    user = {g.sample_id: g.meta[USER_ERROR_KEY] for g in groups if USER_ERROR_KEY in g.meta}
    incomplete = {g.sample_id: g.missing() for g in groups
                  if not g.complete and g.sample_id not in filtered and g.sample_id not in user}
    if incomplete and on_incomplete == "raise":
        raise IncompleteGroupError(incomplete)
    kept, dropped = [], []
    for g in groups:
        if g.sample_id in filtered:
            dropped.append((g.sample_id, FILTERED))
            continue
        if g.sample_id in user:
            dropped.append((g.sample_id, f"{USER_ERROR}: {user[g.sample_id]}"))
            continue
        if g.sample_id in incomplete:
            dropped.append((g.sample_id, f"incomplete: {incomplete[g.sample_id]}"))
            continue
        oldest = oldest_version(g)
        if max_version_gap is not None and oldest is not None and current_version - oldest > max_version_gap:
            dropped.append((g.sample_id, f"stale: oldest token version {oldest}, trainer version "
                                         f"{current_version}, gap above max_version_gap={max_version_gap}"))
            continue
        kept.append(g)
    return kept, dropped


def assemble(groups: Sequence[Group], *, pad_token_id: int = 0, norm_adv_by_std: bool = True,
             stop_token_id: int | None = None) -> TensorDict:
    """Build the training batch of ``groups`` (all complete) with GRPO advantages; see the module doc."""
    if not groups:
        raise ValueError("assemble needs at least one group")
    incomplete = {g.sample_id: g.missing() for g in groups if not g.complete}
    if incomplete:
        raise IncompleteGroupError(incomplete)
    rows = [t for g in groups for t in sorted(g.trajectories, key=lambda t: t.index)]
    seq_adv = torch.cat([episode_advantages(g, norm_adv_by_std) for g in groups])
    width = max(len(t.prompt_ids) + len(t.response_ids) for t in rows)
    b = len(rows)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    response = torch.zeros((b, width), dtype=torch.long)
    old_logprobs = torch.zeros((b, width), dtype=torch.float32)
    versions = torch.full((b, width), -1, dtype=torch.long)
    group_index = torch.tensor([i for i, g in enumerate(groups) for _ in g.trajectories], dtype=torch.long)
    for i, t in enumerate(rows):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, :p] = torch.from_numpy(t.prompt_ids)
        input_ids[i, p:p + r] = torch.from_numpy(t.response_ids)
        attention[i, :p + r] = 1
        if t.loss_mask is None:  # every response token is the model's
            response[i, p:p + r] = 1
            old_logprobs[i, p:p + r] = torch.from_numpy(t.logprobs.astype("float32"))
            versions[i, p:p + r] = torch.from_numpy(t.versions)
        else:  # observation tokens keep 0 / 0 / -1, whatever the record carries there
            mask = torch.from_numpy(t.loss_mask != 0)
            response[i, p:p + r] = mask.long()
            old_logprobs[i, p:p + r] = torch.from_numpy(t.logprobs.astype("float32")).where(mask, 0.0)
            versions[i, p:p + r] = torch.from_numpy(t.versions).where(mask, -1)
        if stop_token_id is not None:
            stops = np.flatnonzero(t.response_ids == stop_token_id)
            if len(stops):
                response[i, p + int(stops[0]) + 1:p + r] = 0  # the stop token itself is the model's choice
    return TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention,
            "response_mask": response,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "old_logprobs": old_logprobs,
            "versions": versions,
            "advantages": seq_adv[:, None] * response.float(),
            "rewards": torch.tensor([t.reward for t in rows], dtype=torch.float32),
            "group_index": group_index,
        },
        batch_size=[b],
    )


def episode_advantages(group: Group, norm_by_std: bool = True) -> torch.Tensor:
    """The GRPO advantage of each of ``group``'s trajectories (index order), taken per episode.

    The reward is the episode's: the rewards of the group's episodes (`asyncrl.types.episode_of`;
    an episode's trajectories, its branches, share one) are normalised over the episodes, and
    every trajectory gets its episode's advantage. An episode with three branches thus counts
    once in the group's mean and std, not three times. Without branches: plain GRPO.
    """
    ts = sorted(group.trajectories, key=lambda t: t.index)
    episodes = episode_of(group)
    order = sorted(set(episodes))
    rewards = [float(np.mean([t.reward for t, e in zip(ts, episodes) if e == ep])) for ep in order]
    per_episode = grpo_advantages(torch.tensor([rewards], dtype=torch.float32), norm_by_std=norm_by_std)[0]
    at = {ep: i for i, ep in enumerate(order)}
    return per_episode[[at[e] for e in episodes]]


def pad_rows(batch: TensorDict, multiple: int, pad_token_id: int = 0) -> TensorDict:
    """``batch`` with rows appended until its row count is a multiple of ``multiple``.

    Groups of varying size (an endpoint agent's branches) make a mini-batch's row count anything;
    ranks need equal shares. A pad row is one real pad token (an all-masked row could give NaN
    attention) with ``response_mask`` 0: it adds nothing to the loss, its denominator or any
    statistic. ``group_index`` -1 marks it.
    """
    b = batch.batch_size[0]
    extra = -b % multiple
    if not extra:
        return batch
    width = batch["input_ids"].shape[1]
    pad = {k: torch.zeros((extra, width), dtype=v.dtype) for k, v in batch.items() if v.dim() == 2}
    pad["input_ids"].fill_(pad_token_id)
    pad["attention_mask"][:, 0] = 1
    pad["versions"].fill_(-1)
    pad.update(rewards=torch.zeros(extra), group_index=torch.full((extra,), -1, dtype=torch.long))
    padding = TensorDict(pad, batch_size=[extra])
    return torch.cat([batch, padding])


def shard_rows(batch: TensorDict, world_size: int, rank: int) -> TensorDict:
    """Rank ``rank``'s contiguous share of ``batch``, padded (`pad_rows`) to split evenly over ranks.

    Every rank must run the same number of forward/backward passes (FSDP's collectives pair
    up), so the shares are equal; the pad rows weigh nothing (groups of varying size, an endpoint
    agent's branches, make a mini-batch's row count anything).
    """
    batch = pad_rows(batch, world_size)
    share = batch.batch_size[0] // world_size
    return batch[rank * share:(rank + 1) * share]


def micro_batches(batch: TensorDict, size: int) -> list[TensorDict]:
    """Consecutive slices of at most ``size`` rows, each trimmed to its longest real row."""
    out = []
    for start in range(0, batch.batch_size[0], size):
        mb = batch[start:start + size]
        width = int(mb["attention_mask"].sum(-1).max().item())
        out.append(mb.apply(lambda x: x[:, :max(width, 1)] if x.dim() == 2 else x, batch_size=mb.batch_size))
    return out
