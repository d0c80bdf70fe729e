"""One response's state in one record (`Response`; an agent loop's run: `Conversation`), and its
outcome, typed: what ended (`Ended`), then what the group keeps (`ResponseOutcome`).

A single-turn response lives in a `Response` from its first request to its trajectory (as
nano-vllm keeps a request in one ``Sequence``): which sample and index it is, the parts it
generated so far across truncations (`PartialResponse`, with its age), the replica that served
it, and where it stands. Partial rollout's `Rounds.truncated` holds these records; a checkpoint
saves only their parts, in `PartialResponse.to_json`'s layout.

An agent loop's run for response ``k`` lives in a `Conversation` the same way: the turn in flight
(its parts across that turn's truncations), the truncations its turns survived, the replica its
last request went to (noted by `GroupCalls` as the request goes out: where a turn given up is
aborted and where its sessions' KV lives), its turns and session ids, where it stands, then what
the run returned and each trajectory's reward under way. The agent's `LLM` adapter
(`asyncrl.rollouter.agents.RolloutLLM`) keeps none of it: it reads and writes the record. A
conversation is never checkpointed (``checkpointed``): one in flight at a crash is generated
again from its start.

A response (or one session or branch of an agent loop's run) ends with its tokens, the replica
that finished it and its reward under way (`asyncrl.rollouter.rewards.Rewards.start`). Its
`Trajectory` is built once, when that reward is in (`Ended.settle`), with the reward in it: no
placeholder is written first and overwritten later, so a trajectory with no reward (an agent
episode whose env gave none and for which none was started) fails its group with one line,
instead of being trained on a made-up 0.0. The group builds its `ResponseOutcome` records from
these and never changes them after.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np

from asyncrl.rollouter.partial import PartialResponse
from asyncrl.rollouter.rewards import Pending, Rewards
from asyncrl.turns import to_trajectory
from asyncrl.types import Trajectory

Status = Literal["running", "truncated", "finished"]


@dataclass(eq=False, slots=True)
class Response:
    """One single-turn response of a group in flight, from its first request to its trajectory."""

    sample_id: str
    """Its prompt's id (``sample_{epoch}_{index}``)."""
    k: int
    """Which of the group's ``n`` responses it is."""
    parts: PartialResponse = field(default_factory=PartialResponse)
    """What it generated so far, across truncations (a checkpoint saves this)."""
    replica: int = -1
    """The engine replica of its last request (-1: none yet)."""
    status: Status = "running"
    """``running`` (on an engine, or about to be), ``truncated`` (waiting for the next round), ``finished``."""
    prompt_ids: np.ndarray | None = None
    """Its prompt's token ids (set when it starts, or resumes from a checkpoint)."""
    finish_reason: str | None = None
    """How it ended (``length`` for one stopped at its budget by truncations); None until it finished."""
    tokens: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    """``(response_ids, logprobs, versions)``, its parts joined once when it finished."""
    reward: Pending | None = None
    """Its reward under way (`Rewards.start`), once it finished."""

    checkpointed: ClassVar[bool] = True
    """A truncation puts it in `Rounds.truncated`: a checkpoint saves its parts."""

    @property
    def age(self) -> int:
        """Truncations it survived."""
        return self.parts.age

    def finish(self, finish_reason: str, replica: int) -> np.ndarray:
        """It ended on ``replica``: join its parts once; returns its response ids (what its reward reads)."""
        self.status, self.replica = "finished", replica
        self.finish_reason = finish_reason if finish_reason != "truncated" else "length"
        self.tokens = self.parts.joined()
        return self.tokens[0]

    def trajectory(self, index: int, reward: float | None) -> Trajectory:
        """Its trajectory as response ``index``, with ``reward`` (`Ended.build`); raises with none."""
        if reward is None:
            raise missing_reward(self.sample_id, index)
        if self.tokens is None or self.prompt_ids is None:
            raise RuntimeError(f"{self.sample_id}/{self.k}: trajectory() before finish() (status {self.status})")
        response_ids, logprobs, versions = self.tokens
        n = len(response_ids)
        if len(logprobs) != n or len(versions) != n:
            raise ValueError(f"{self.sample_id}[{index}]: the engine gave {n} response ids, {len(logprobs)} "
                             f"log-probs and {len(versions)} versions (one of each per token expected)")
        # Typed already (the parts joined as int64 / float32 / int64, the prompt's ids int64): built
        # without the constructor's conversions, which cost a busy Rollouter ~1 us per response.
        return Trajectory._from_typed(self.sample_id, index, np.asarray(self.prompt_ids, np.int64), response_ids,
                                      logprobs, versions, self.finish_reason, reward, self.parts.age)

    def ended(self) -> Ended:
        """What the group settles (`settle`): response ``k``, its replica, its reward under way."""
        return Ended(self.k, self.replica, self.reward, self.trajectory)


@dataclass(eq=False, slots=True)
class Conversation:
    """One agent loop's run as response ``k`` of a group, from its first turn to its trajectories."""

    sample_id: str
    """Its prompt's id (``sample_{epoch}_{index}``)."""
    k: int
    """Which of the group's ``n`` runs it is."""
    parts: PartialResponse | None = None
    """Its turn in flight, across that turn's truncations (a new one each turn; None before the first)."""
    age: int = 0
    """Truncations its turns survived (a turn's, added when the turn ends)."""
    replica: int = -1
    """The engine replica its last request went to (-1: none went out): its sessions' KV lives there."""
    status: Status = "running"
    """``running`` (a turn on an engine, or the loop between turns), ``truncated`` (a turn waiting
    for the next round), ``finished`` (the run returned)."""
    turns: int = 0
    """Turns asked for so far."""
    session_id: str = ""
    """The session its turns go under now (``{sample_id}/{k}``, then ``/s{j}`` for the j-th conversation after it)."""
    sessions: list[str] = field(default_factory=list)
    """Every session it opened: each is ended on ``replica`` when the run ends, however it ends."""
    engine_error: BaseException | None = None
    """The engine's error that ended a turn: it fails the group as the engine's, not the loop's."""
    episodes: Sequence[Any] = ()
    """What the run returned (`asyncrl.agent.AgentTrajectory`s: one per session or branch)."""
    rewards: Sequence[Pending | None] = ()
    """Each episode's reward under way (None: its env gave one, it is in the episode)."""

    checkpointed: ClassVar[bool] = False
    """Never saved: a conversation in flight at a crash is generated again from its start."""

    @property
    def id(self) -> str:
        """``{sample_id}/{k}``: its request ids' stem, its first session and its episode id."""
        return f"{self.sample_id}/{self.k}"

    def finish(self, episodes: Sequence[Any], rewards: Sequence[Pending | None], first: int) -> list[Ended]:
        """The run returned ``episodes`` (their ``rewards`` under way): each one `Ended`, numbered
        from ``first`` in the group, with the replica of the last turn. No turn is in flight now: the
        last one's parts are let go (the episodes hold its tokens)."""
        self.status, self.episodes, self.rewards, self.parts = "finished", episodes, rewards, None
        return [Ended(first + s, self.replica, reward, partial(self.trajectory, ep))
                for s, (ep, reward) in enumerate(zip(episodes, rewards))]

    def trajectory(self, episode: Any, index: int, reward: float | None) -> Trajectory:
        """``episode``'s trajectory as response ``index`` with ``reward``; `to_trajectory` raises
        when it has none at all (its env gave none and none was given)."""
        return to_trajectory(episode, sample_id=self.sample_id, index=index, reward=reward, age=self.age)


class ResponseOutcome(NamedTuple):
    """One trajectory of a group, with the replica that finished it (the aggregator's count).
    Immutable (a named tuple: one is built per response, so its construction is kept cheap)."""

    trajectory: Trajectory
    """The response, its reward in it."""
    replica: int
    """The engine replica of its last request (an agent run: of its last turn)."""


class Ended(NamedTuple):
    """A response that ended, its reward under way: `settle` builds its trajectory once the reward is
    in. Immutable (a named tuple, as `ResponseOutcome`)."""

    index: int
    """Its index in the group (an agent run with branches: renumbered in response order)."""
    replica: int
    """The engine replica of its last request."""
    reward: Pending | None
    """Its reward under way (`Rewards.start`); None: none was started (an env's reward is in the episode)."""
    build: Callable[[int, float | None], Trajectory]
    """``(index, reward) -> Trajectory``: raises when the response has no reward at all."""

    def renumbered(self, index: int) -> Ended:
        """The same response as the group's ``index``-th trajectory (an episode's branches, in response order)."""
        return self._replace(index=index)

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
            reward = None
            if o.reward is not None:
                reward = Rewards.done_value(o.reward)
                if reward is None:
                    reward = await Rewards.value(o.reward)
        except Exception as exc:  # noqa: BLE001 - the user's reward function
            outcomes.append(reward_error(exc))
            continue
        try:
            outcomes.append(o.settle(reward))
        except Exception as exc:  # noqa: BLE001 - no reward, or a malformed episode
            outcomes.append(exc)
    return outcomes
