"""The built-in roles: ``rollout`` (a train step's batch of groups) and ``async_rollout`` (one group).

``rollout`` wraps the synchronous path's batch generation; its step is the train step that
the loop gives `SkipManager.set_step`. ``async_rollout`` wraps `Rollouter.generate_group`; its
step is the feed index in the call's own ``sample_id`` (``sample_{epoch}_{index}``), so
concurrent samples resolve their steps independently and nothing mutable is shared.

A replayed group is marked (`REPLAY_KEY` in ``Group.meta``) and carries the ``sample_id`` of
the call it stands in for: under ``repeat`` a dump of another step answers, and the Trainer
de-duplicates by ``sample_id``. What the Trainer then does with a replayed group's versions
and behaviour log-probs: `rebase_versions` and docs/skip.md.
Failed or incomplete groups are never dumped (a transient engine error must not be replayed).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from asyncrl.skip.manager import BaseSkip, SkipCall, register_skip
from asyncrl.skip.store import DumpError
from asyncrl.types import Group, Trajectory, make_sample_id, parse_sample_id

REPLAY_KEY = "skip_replay"
"""``Group.meta`` key of a replayed group: ``{"role", "experiment", "step", "source_step",
"source_sample_id", "temperature"}`` (temperature: the one the behaviour log-probs were taken at)."""


def is_replayed(group: Group) -> bool:
    return REPLAY_KEY in group.meta


def relabel(group: Group, sample_id: str, mark: dict) -> Group:
    """``group`` as the group of ``sample_id``, marked with ``mark`` under `REPLAY_KEY`."""
    trajectories = group.trajectories
    if sample_id != group.sample_id:
        trajectories = [dataclasses.replace(t, sample_id=sample_id) for t in trajectories]
    mark = {**mark, "source_sample_id": group.sample_id}
    return Group(sample_id=sample_id, trajectories=trajectories, expected=group.expected, status=group.status,
                 error=group.error, meta={**group.meta, REPLAY_KEY: mark})


def rebase_versions(group: Group, version: int) -> Group:
    """A replayed group whose tokens all carry ``version``.

    The dumped versions count the weight syncs of the run that dumped them, which mean nothing
    on this run's timeline; left alone they would make ``max_version_gap`` drop (or keep) the
    group by accident. Rebasing treats a replayed group as produced now. Its behaviour
    log-probs are kept: they are the probabilities of the distribution that really sampled the
    tokens, so the loss's importance ratio against them is the correct off-policy correction.
    """
    trajectories = [dataclasses.replace(t, versions=_rebased(t, version)) for t in group.trajectories]
    mark = {**group.meta[REPLAY_KEY], "rebased_to_version": version}
    return Group(sample_id=group.sample_id, trajectories=trajectories, expected=group.expected,
                 status=group.status, error=group.error, meta={**group.meta, REPLAY_KEY: mark})


def _rebased(t: Trajectory, version: int) -> np.ndarray:
    # Observation tokens of a conversation keep -1: no policy wrote them, now or then.
    versions = np.full(len(t.response_ids), version, np.int64)
    if t.loss_mask is not None:
        versions[t.loss_mask == 0] = -1
    return versions


def _incomplete(groups: list[Group]) -> str:
    bad = [f"{g.sample_id} ({g.missing()})" for g in groups if not g.complete]
    return f"incomplete group(s) {', '.join(bad)}" if bad else ""


class _GroupSkip(BaseSkip):
    def _mark(self, step: int, source: int) -> dict:
        mark = {"role": self.role, "experiment": self.store.key.experiment, "step": step, "source_step": source}
        if "temperature" in self.store.key.shape:
            mark["temperature"] = self.store.key.shape["temperature"]
        return mark


@register_skip("rollout")
class RolloutSkip(_GroupSkip):
    """A train step's groups (``list[Group]``), keyed by `SkipManager.set_step`'s train step.

    A dump of another step (``repeat``) is relabelled by shifting each feed index by
    ``(step - source) * len(groups)``: the synchronous path feeds each train step the next
    ``len(groups)`` prompts, so the shifted ids are the ones this step would have used.
    """

    support_online_step = False

    def should_dump(self, result) -> str:
        if not isinstance(result, list) or not all(isinstance(g, Group) for g in result):
            return f"the rollout role dumps a list of Groups, got {type(result).__name__}"
        return _incomplete(result)

    def replayed(self, value, *, step: int, source: int, call: SkipCall):
        shift = (step - source) * len(value)
        out = []
        for g in value:
            epoch, index = parse_sample_id(g.sample_id)
            if index + shift < 0:
                raise DumpError(f"step {source}'s {g.sample_id} cannot stand in for step {step}")
            out.append(relabel(g, make_sample_id(epoch, index + shift), self._mark(step, source)))
        return out


@register_skip("async_rollout")
class AsyncRolloutSkip(_GroupSkip):
    """One sample's `Group`, keyed by the feed index of the call's ``sample_id`` argument.

    ``@SkipManager.annotate(role="async_rollout", step_arg="sid")`` names another argument.
    """

    support_online_step = True

    def extract_step(self, call: SkipCall) -> int:
        name = call.options.get("step_arg", "sample_id")
        if name not in call.arguments:
            raise TypeError(f"skip.async_rollout: {call.function.__qualname__} has no argument {name!r} "
                            "holding the sample_id (annotate(..., step_arg=NAME) names it)")
        return parse_sample_id(call.arguments[name])[1]

    def should_dump(self, result) -> str:
        if not isinstance(result, Group):
            return f"the async_rollout role dumps a Group, got {type(result).__name__}"
        return _incomplete([result])

    def replayed(self, value, *, step: int, source: int, call: SkipCall):
        if not isinstance(value, Group):
            raise DumpError(f"step {source}'s dump holds a {type(value).__name__}, not a Group")
        sample_id = call.arguments[call.options.get("step_arg", "sample_id")]
        return relabel(value, sample_id, self._mark(step, source))
