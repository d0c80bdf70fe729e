"""A response's outcome, typed: what ended (`Ended`), then what the group keeps (`ResponseOutcome`).

A response (or one session or branch of an agent loop's run) ends with its tokens, the replica
that finished it and its reward under way (`asyncrl.rollouter.rewards.Rewards.start`). Its
`Trajectory` is built once, when that reward is in (`Ended.settle`), with the reward in it: no
placeholder is written first and overwritten later, so a trajectory with no reward (an agent
episode whose env gave none and for which none was started) fails its group with one line,
instead of being trained on a made-up 0.0. The group builds its `ResponseOutcome` records from
these and never changes them after.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from asyncrl.rollouter.rewards import Pending, Rewards
from asyncrl.types import Trajectory


@dataclass(frozen=True)
class ResponseOutcome:
    """One trajectory of a group, with the replica that finished it (the aggregator's count)."""

    trajectory: Trajectory
    """The response, its reward in it."""
    replica: int
    """The engine replica of its last request (an agent run: of its last turn)."""


@dataclass(frozen=True)
class Ended:
    """A response that ended, its reward under way: `settle` builds its trajectory once the reward is in."""

    index: int
    """Its index in the group (an agent run with branches: renumbered in response order)."""
    replica: int
    """The engine replica of its last request."""
    reward: Pending | None
    """Its reward under way (`Rewards.start`); None: none was started (an env's reward is in the episode)."""
    build: Callable[[int, float | None], Trajectory]
    """``(index, reward) -> Trajectory``: raises when the response has no reward at all."""

    def settle(self, reward: float | None) -> ResponseOutcome:
        """The outcome, its trajectory built now with ``reward`` (the awaited value of `reward`)."""
        return ResponseOutcome(self.build(self.index, reward), self.replica)


def missing_reward(sample_id: str, index: int) -> ValueError:
    """The one-line error of a response that ended with no reward."""
    return ValueError(f"{sample_id}[{index}]: the response has no reward (its env gave none and no reward "
                      "was started for it; the task's reward function scores a response that has none)")


async def settle(ended: list[Ended | BaseException],
                 reward_error: Callable[[Exception], BaseException]) -> list[ResponseOutcome | BaseException]:
    """Each ended response's outcome, its trajectory built once its reward is in (started as it
    ended: most are done by now); an error stays as it is. A reward that raises becomes
    ``reward_error(exc)`` (the user's error); a response left with no reward at all
    (`missing_reward`), or one whose trajectory cannot be built, fails the group like an engine's error."""
    outcomes: list[ResponseOutcome | BaseException] = []
    for o in ended:
        if not isinstance(o, Ended):
            outcomes.append(o)
            continue
        try:
            reward = None if o.reward is None else await Rewards.value(o.reward)
        except Exception as exc:  # noqa: BLE001 - the user's reward function
            outcomes.append(reward_error(exc))
            continue
        try:
            outcomes.append(o.settle(reward))
        except Exception as exc:  # noqa: BLE001 - no reward, or a malformed episode
            outcomes.append(exc)
    return outcomes
