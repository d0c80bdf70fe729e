"""The agent interfaces: `Env`, `Step`, `AgentLoop`, the `LLM` a loop talks to, and the records
they exchange (`Turn`, `AgentTrajectory`).

Two ways in (DESIGN.md, "Agent loops"):

- an `Env` (two methods, SkyRL's text-environment shape): ``reset(prompt) -> messages`` and
  ``step(assistant_text) -> Step``; asyncrl owns the loop (`asyncrl.agent.loop.EnvLoop`);
- an `AgentLoop` (one method, verl's shape): ``run(prompt, llm) -> AgentTrajectory | list[...]``,
  full control over what is generated and appended.

Token in, token out: a loop hands the `LLM` token ids and gets back the exact token ids the
engine sampled, with their behaviour log-probs and per-token versions. Nothing here imports
torch or ray.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

AgentFinishReason = Literal["stop", "length", "abort", "truncated", "max_turns", "context"]
AGENT_FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "truncated", "max_turns", "context")

#: Version carried by observation tokens: no policy wrote them.
OBSERVATION_VERSION = -1

Message = dict[str, Any]
"""A chat message as chat templates take it: ``{"role": ..., "content": ...}`` (plus e.g. ``name``)."""


@dataclass(slots=True)
class Step:
    """What an `Env` answers to one assistant turn."""

    observation: str | list[Message] | None = None
    """The reply appended before the next turn: a text (a ``user`` message), a list of messages
    (e.g. ``role="tool"``), or None / ``[]`` for nothing (a finished episode)."""
    reward: float | None = None
    """The episode's reward so far; the last one given is the trajectory's. None: the task's
    reward function scores the final text."""
    done: bool = False
    """True ends the episode after this turn (finish reason ``stop``)."""
    tool_calls: int = 0
    """Tool calls made while answering this turn (counted in the trajectory)."""
    tool_errors: int = 0
    """Of those, the ones that ended in an error observation (raised, timed out, bad output,
    unknown tool, malformed call)."""


class Env(abc.ABC):
    """A user's environment: asyncrl renders the conversation, generates a turn, calls `step`.

    One instance serves one episode (one trajectory); the loop calls `close` when it ends.
    """

    @abc.abstractmethod
    async def reset(self, prompt: Any) -> str | list[Message]:
        """The opening messages for ``prompt`` (a text is one ``user`` message)."""

    @abc.abstractmethod
    async def step(self, assistant_text: str) -> Step:
        """React to the model's turn (its decoded text, end-of-turn marker stripped)."""

    tools: tuple[dict, ...] = ()
    """JSON schemas of the tools the chat template shows the model (`ToolEnv` fills it)."""
    episode_id: str | None = None
    """The conversation's id, set by the loop before `reset`: ``{sample_id}/{k}`` in a run (response
    ``k`` of the prompt), the same when the conversation is generated again after a resume; None
    outside one. A `ToolEnv` builds each call's key from it (``call_key``, docs/agent.md)."""

    async def close(self) -> None:
        """Release what the episode held (default: nothing)."""


@dataclass(slots=True)
class Turn:
    """One generated turn: what `LLM.generate` returns."""

    token_ids: np.ndarray
    """The exact token ids the engine sampled, int64 (a stop token included when it ended on one)."""
    logprobs: np.ndarray
    """Behaviour log-prob of each token under the weights that sampled it, float32."""
    versions: np.ndarray
    """Policy version (weight syncs so far) that produced each token, int64."""
    finish_reason: str
    """The engine's: ``stop`` | ``length`` | ``abort`` | ``truncated``."""

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int64)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        self.versions = np.asarray(self.versions, dtype=np.int64)
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(f"Turn: token_ids, logprobs and versions need one entry per token, "
                             f"got {n}, {len(self.logprobs)}, {len(self.versions)}")


@runtime_checkable
class LLM(Protocol):
    """The policy as an agent loop sees it: one call, one turn."""

    async def generate(self, token_ids, *, max_tokens: int, stop: tuple[int, ...] = ()) -> Turn:
        """Continue ``token_ids`` (the whole conversation so far) by at most ``max_tokens``
        tokens, ending early on an end-of-sequence token or any id in ``stop``."""
        ...


@dataclass(eq=False, slots=True)
class AgentTrajectory:
    """One episode, token in, token out: the prompt, then every model turn and observation in order.

    Model tokens carry ``loss_mask`` 1 and their behaviour log-probs and versions; observation
    tokens (tool output, env replies, the chat template's markers between turns) carry
    ``loss_mask`` 0, log-prob 0 and version `OBSERVATION_VERSION` (-1): no policy wrote them.
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: AgentFinishReason
    reward: float | None = None
    """The env's last `Step.reward`; None: the task's reward function scores ``final_text``."""
    turns: int = 0
    """Model turns generated."""
    tool_calls: int = 0
    tool_errors: int = 0
    final_text: str = ""
    """The last model turn's text (what a task's reward function reads)."""

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int64)
        self.response_ids = np.asarray(self.response_ids, dtype=np.int64)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.uint8)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        self.versions = np.asarray(self.versions, dtype=np.int64)
        n = len(self.response_ids)
        lengths = {k: len(getattr(self, k)) for k in ("loss_mask", "logprobs", "versions")}
        if any(v != n for v in lengths.values()):
            raise ValueError(f"AgentTrajectory: loss_mask, logprobs and versions need one entry per "
                             f"response token ({n}), got {lengths}")
        if self.finish_reason not in AGENT_FINISH_REASONS:
            raise ValueError(f"AgentTrajectory: finish_reason {self.finish_reason!r} is not one of "
                             f"{AGENT_FINISH_REASONS}")

    @property
    def model_tokens(self) -> int:
        """Response tokens the model wrote (those the loss sees)."""
        return int(self.loss_mask.sum())


class AgentLoop(abc.ABC):
    """Full control: run one episode for ``prompt`` against ``llm``.

    Return one `AgentTrajectory`, or several (one per session) when a prompt yields more than
    one output; the group then counts sessions.
    """

    @abc.abstractmethod
    async def run(self, prompt: Any, llm: LLM) -> AgentTrajectory | list[AgentTrajectory]:
        """Generate with ``llm`` (each call one turn) and return the episode's trajectory(ies)."""
