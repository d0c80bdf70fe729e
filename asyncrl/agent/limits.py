"""The agent settings, each declared once with its check: an episode's limits (`EnvLoopConfig`)
and how tool calls run (`ToolRunnerConfig`).

`EnvLoop` takes the first, `ToolRunner` (and so `ToolEnv`) the second; the run's
``rollout.agent`` section (`asyncrl.rollouter.config.AgentConfig`) is built on both, so its keys
``rollout.agent.max_turns``, ``rollout.agent.tool_timeout_s``, ... are these fields, and a run hands
its `AgentConfig` to the loop and the runner as it is. A bad value is refused where the record is
built, with the class and the field named. Nothing of torch or Ray is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SYNC_TOOLS = ("process", "thread")

_RENAMED = {"max_concurrent": "tool_concurrency", "sync_workers": "sync_tool_workers"}


@dataclass(kw_only=True)
class EnvLoopConfig:
    """Limits of one episode."""

    max_turns: int = 8
    """Most model turns per episode (an endpoint agent: calls); an env not done by then ends with ``max_turns``."""
    max_tokens_per_turn: int = 512
    """Token budget of one model turn (an endpoint agent's call: the most it may ask); a turn that uses
    all of it ends the episode with ``length``."""
    max_context_tokens: int = 4096
    """Prompt + every turn and observation (an endpoint agent: of a branch); what would not fit ends
    the episode with ``context``."""

    def __post_init__(self) -> None:
        self.check_episode_limits()

    def check_episode_limits(self) -> None:
        """`ValueError` naming the first field out of range."""
        for name in ("max_turns", "max_tokens_per_turn", "max_context_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(kw_only=True)
class ToolRunnerConfig:
    """How tool calls run."""

    tool_timeout_s: float = 30.0
    """Deadline of one tool call of a `ToolEnv`; past it the call's observation is a timeout error."""
    tool_concurrency: int = 8
    """Most tool calls running at once on one runner (in a run: all of the Rollouter process's episodes)."""
    sync_tools: str = "process"
    """Where a `ToolEnv`'s sync tools run: ``process`` (worker processes; one past its timeout is
    killed, so a hung tool ends only its call; tools must pickle and share no state in-process) or
    ``thread`` (a pool of ``tool_concurrency`` threads; a hung call keeps its thread)."""
    sync_tool_workers: int = 4
    """Worker processes for sync tools (``sync_tools=process``), started at the first sync call."""

    def __post_init__(self) -> None:
        self.check_tool_settings()

    def check_tool_settings(self) -> None:
        """`ValueError` naming the first field out of range."""
        who = type(self).__name__
        if not self.tool_timeout_s > 0:
            raise ValueError(f"{who}.tool_timeout_s must be > 0, got {self.tool_timeout_s}")
        if self.sync_tools not in SYNC_TOOLS:
            raise ValueError(f"{who}.sync_tools must be process or thread, got {self.sync_tools!r}")
        for name in ("tool_concurrency", "sync_tool_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{who}.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def of(cls, settings: dict[str, Any], where: str) -> ToolRunnerConfig:
        """``cls(**settings)``; a key that is not a field is a `TypeError` naming it (and its new name,
        for the two that were renamed) and ``where`` it was given."""
        unknown = sorted(set(settings) - set(cls.__dataclass_fields__))
        if unknown:
            key = unknown[0]
            fix = (f"it is now {_RENAMED[key]}" if key in _RENAMED
                   else f"the settings are {', '.join(cls.__dataclass_fields__)}")
            raise TypeError(f"{where}: unknown tool setting {key!r}: {fix}")
        return cls(**settings)
