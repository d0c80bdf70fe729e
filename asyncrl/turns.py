"""From an agent loop's episode to the record the stream carries.

`to_trajectory` turns an `asyncrl.agent.AgentTrajectory` (token in, token out: model turns and
observations in order, with their loss mask) into the `asyncrl.types.Trajectory` of a group.
It lives outside ``asyncrl.agent`` so that the records stay the one thing every part shares and
the agent package can import it; it reads the episode by its fields (no import of the agent
package here), so it also takes any object shaped like one.

A mask of all ones (plain generation as the trivial loop) becomes ``loss_mask=None``: on the
wire and in the Trainer that is the single-turn case, so it costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from asyncrl.types import Trajectory

if TYPE_CHECKING:
    from asyncrl.agent.base import AgentTrajectory


def to_trajectory(episode: AgentTrajectory, *, sample_id: str, index: int, reward: float | None = None,
                  age: int = 0) -> Trajectory:
    """The `Trajectory` of ``episode`` as response ``index`` of ``sample_id``.

    ``reward`` is the task's reward of the episode's final text; it is needed only when the
    env gave none (``episode.reward is None``), and the env's reward wins when both are given.
    """
    score = episode.reward if episode.reward is not None else reward
    if score is None:
        raise ValueError(f"{sample_id}[{index}]: the episode has no reward from its env and none was "
                         "given (pass reward=, the task's reward of its final text)")
    mask = np.asarray(episode.loss_mask)
    return Trajectory(
        sample_id=sample_id, index=index, prompt_ids=episode.prompt_ids, response_ids=episode.response_ids,
        logprobs=episode.logprobs, versions=episode.versions, finish_reason=episode.finish_reason,
        reward=float(score), age=age, loss_mask=None if mask.all() else mask, turns=int(episode.turns),
    )
