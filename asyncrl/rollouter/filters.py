"""Dynamic sampling: which finished groups go on to be trained (``rollout.group_filter``).

GRPO learns nothing from a group whose rewards are all equal: its advantages are zero. DAPO's
dynamic sampling drops such groups and samples more prompts until the batch is full. Here the
Rollouter judges each finished group before it is sent (`Rollouter._one_group`):

- ``none`` keeps every group; ``zero_std`` drops a group whose rewards are all equal;
  ``module:function`` is the user's ``fn(view: GroupView) -> bool`` (True keeps it). It runs on
  the Rollouter's event loop, so keep it cheap; keep it deterministic too, so that a group the
  ``async_rollout`` skip role replays from a dump gets the same answer (the dumps hold groups
  as generated, before any filter).
- Only complete groups are judged: a failed group stays failed, and a group with a truncated
  response (partial rollout) is judged once that response ends. A filter that raises, or
  returns anything but a bool, is the user's error (`GroupFilterError`, a `UserCodeError`):
  ``rollout.on_user_error`` stops the run or drops the group (`asyncrl.usercode`).
- A dropped group is sent all the same, marked (`asyncrl.types.FILTERED_KEY` in its meta): the
  Trainer trains none of it and records it in ``samples.jsonl`` as dropped, reason ``filtered``,
  once its step is durable, like any drop. So exactly once holds across a crash: a drop not yet
  durable is generated and judged again at resume, a durable one is never generated again.
  The Rollouter gives its staleness budget back at once, so the gate admits a replacement.
- ``rollout.max_filtered_in_a_row`` groups dropped in a row stop the run (`GroupFilterStalled`)
  instead of generating forever for a batch that never fills.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from asyncrl.types import FILTERED_KEY, Group, episode_of
from asyncrl.usercode import UserCodeError

BUILTIN = ("none", "zero_std")


class GroupFilterError(UserCodeError):
    """A ``module:function`` group filter raised or returned a non-bool (a user error)."""


class GroupFilterStalled(RuntimeError):
    """``max_filtered_in_a_row`` groups in a row were dropped: nothing passes the filter."""


@dataclass(frozen=True)
class GroupView:
    """What a group filter sees of a finished group (read-only; arrays in response index order)."""

    sample_id: str
    rewards: np.ndarray
    """float64, one per response."""
    lengths: np.ndarray
    """Response tokens of each response, int64."""
    finish_reasons: tuple[str, ...]
    meta: dict
    """The prompt's text (``prompt``) and its dataset row's meta (a copy)."""
    episodes: np.ndarray | None = None
    """int64, the response (episode) of each trajectory: an endpoint agent's branches share their
    episode's reward (`asyncrl.types.EPISODES_KEY`); 0..len-1 when each response is one trajectory."""

    @classmethod
    def of(cls, group: Group) -> GroupView:
        ts = sorted(group.trajectories, key=lambda t: t.index)
        rewards = np.array([t.reward for t in ts], dtype=np.float64)
        lengths = np.array([len(t.response_ids) for t in ts], dtype=np.int64)
        episodes = np.array(episode_of(group), dtype=np.int64)
        rewards.flags.writeable = lengths.flags.writeable = episodes.flags.writeable = False
        return cls(group.sample_id, rewards, lengths, tuple(t.finish_reason for t in ts), dict(group.meta), episodes)


def zero_std(view: GroupView) -> bool:
    """DAPO's dynamic sampling: keep a group only if its rewards are not all equal."""
    return bool(len(view.rewards) and np.ptp(view.rewards) > 0)


def load(spec: str) -> Callable[[GroupView], bool] | None:
    """``none`` -> None; ``zero_std`` or ``module:function`` -> the filter. ValueError naming
    ``rollout.group_filter`` for a spec that is malformed, does not import or is not callable."""
    if spec == "none":
        return None
    if spec == "zero_std":
        return zero_std
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"rollout.group_filter must be none, zero_std or module:function, got {spec!r}")
    from asyncrl.importpath import load_path

    return load_path(spec, "rollout.group_filter", ValueError, want_callable=True)


class GroupFilter:
    """``rollout.group_filter`` loaded, with the count of groups it dropped in a row."""

    def __init__(self, spec: str, max_in_a_row: int):
        self.spec, self.max_in_a_row = spec, max_in_a_row
        self.fn = load(spec)
        self.in_a_row = 0
        self.judged = self.dropped = 0

    def judge(self, group: Group) -> Group:
        """``group`` as it goes on: as it is if kept (or not complete: only complete groups are
        judged), marked with `FILTERED_KEY` if dropped. Raises `GroupFilterError` if the filter
        failed, `GroupFilterStalled` when this drop is the ``max_in_a_row``-th in a row."""
        if self.fn is None or not group.complete:
            return group
        kept = self.keep(group)
        return group if kept else dataclasses.replace(group, meta={**group.meta, FILTERED_KEY: self.spec})

    def keep(self, group: Group) -> bool:
        """True to train ``group`` (complete); raises `GroupFilterError` if the user's filter
        fails, `GroupFilterStalled` when this drop is the ``max_in_a_row``-th in a row."""
        if self.fn is None:
            return True
        try:
            verdict = self.fn(GroupView.of(group))
        except Exception as e:  # noqa: BLE001 - the user's code
            raise GroupFilterError.of(e, f"rollout.group_filter={self.spec}", group.sample_id) from e
        if not isinstance(verdict, (bool, np.bool_)):
            raise GroupFilterError(f"rollout.group_filter={self.spec} returned {verdict!r}; it must return "
                                   "True (keep the group) or False (drop it)", where=f"rollout.group_filter={self.spec}",
                                   sample_id=group.sample_id)
        self.judged += 1
        if verdict:
            self.in_a_row = 0
            return True
        self.dropped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.max_in_a_row:
            raise GroupFilterStalled(
                f"rollout.group_filter={self.spec} dropped {self.in_a_row} groups in a row "
                f"(rollout.max_filtered_in_a_row={self.max_in_a_row}): nothing passes it, so no batch would "
                "ever fill; check the filter and the rewards, or raise rollout.max_filtered_in_a_row")
        return False
