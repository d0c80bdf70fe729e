"""Where the endpoint serves (``rollout.agent.endpoint_server``): the interface `EndpointHost`, the
record of an ended episode, and the host on the Rollouter's own event loop.

- ``loop`` (`LoopHost`): the HTTP server runs on the Rollouter's event loop; nothing more to start.
- ``process`` (`asyncrl.agent.endpoint.process.ProcessHost`): the HTTP server, the episodes and
  their token-exact histories run in a process of their own next to the Rollouter, which serves
  only each call's generation (`RolloutLLM`: pause-keep across a sync, versions, partial rollout).
  The Rollouter's loop then holds no HTTP request, parsed body or history, and its collector walks
  none of them (docs/benchmarks.md, the endpoint bench).

Either way an episode is opened with the `LLM` its calls generate on, and closed into an
`EpisodeRecord`: what `EndpointLoop` counts and trains.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from asyncrl.agent.base import LLM, AgentTrajectory
from asyncrl.agent.endpoint.episode import Episode, EpisodeLimits
from asyncrl.agent.endpoint.server import EndpointServer
from asyncrl.agent.endpoint.tls import share_default_tls_context

HOSTS = ("loop", "process")


class HostGone(RuntimeError):
    """The endpoint's host went away (its process exited): the episodes open on it cannot end well."""


@dataclass(frozen=True, slots=True)
class EpisodeRecord:
    """An ended episode, as its host saw it."""

    id: str
    calls: int
    """Calls admitted."""
    turns: int
    """Answers sampled and recorded (every branch's)."""
    tool_calls: int
    tool_call_turns: int
    forks: int
    divergences: list
    """(index, message) of each fork's first differing message."""
    reward: float | None
    """A reward posted to the endpoint (None: none)."""
    limit_hit: str | None
    """The first per-episode limit a call was refused for (None: none)."""
    trajectories: list[AgentTrajectory]
    """Each branch's trajectory, its reward not set: the main branch (the last call's) first, the
    others in the order they began; only the main one with ``branches="main"``; none: no answer."""

    @classmethod
    def of(cls, ep: Episode, branches: str) -> "EpisodeRecord":
        history = ep.history
        if history.last is None:
            kept = []
        elif branches == "main":
            kept = [history.last]
        else:
            kept = [history.last, *(b for b in history.branches if b is not history.last)]
        return cls(ep.id, ep.calls, sum(b.calls for b in history.branches), ep.tool_calls, ep.tool_call_turns,
                   history.forks, list(history.divergences), ep.reward, ep.limit_hit,
                   [b.trajectory(None) for b in kept])


def reward_of(out: Any, name: str) -> float | None:
    """What an agent function returned, as its episode's reward (None: none); a TypeError otherwise."""
    if out is not None and (isinstance(out, bool) or not isinstance(out, (int, float))):
        raise TypeError(f"{name} must return a float reward or None, got {type(out).__name__}")
    return None if out is None else float(out)


class EndpointHost:
    """Serves the endpoint's episodes somewhere: `start` once, then `open` and `close` each episode.
    A host given the agent function (``function``) also runs it, next to its server (`drive`)."""

    url: str
    """``http://host:port`` agents reach (set by `start`)."""
    function: Any = None
    """The agent function this host runs per episode (None: its caller runs the agent)."""

    async def start(self) -> None:
        raise NotImplementedError

    def base_url(self, episode_id: str) -> str:
        return f"{self.url}/s/{episode_id}/v1"

    async def open(self, episode_id: str, llm: LLM) -> str:
        """Serve a new episode whose calls generate on ``llm``: its secret (the API key)."""
        raise NotImplementedError

    async def drive(self, episode_id: str, row: dict, spec: Any) -> float | None:
        """Run the agent function for an open episode: the reward it returned (`reward_of`)."""
        raise NotImplementedError

    async def close(self, episode_id: str, why: str, branches: str) -> EpisodeRecord:
        """End the episode (later calls get 409, calls in flight are aborted) once they are settled."""
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


class LoopHost(EndpointHost):
    """``endpoint_server: loop``: an `EndpointServer` on this event loop."""

    def __init__(self, renderer: Any, limits: EpisodeLimits, model: str, host: str, port: int, *,
                 function: Any = None, name: str = "the agent function"):
        self.renderer, self.limits, self.model = renderer, limits, model
        self.function, self.name = function, name
        self.server = EndpointServer(host, port)
        self._episodes: dict[str, Episode] = {}

    async def start(self) -> None:
        if self.function is not None:  # it builds its HTTP clients in this process
            share_default_tls_context()
        await self.server.start()
        self.url = self.server.url

    async def open(self, episode_id: str, llm: LLM) -> str:
        ep = Episode(episode_id, llm, self.renderer, self.limits, self.model)
        self.server.add(ep)
        self._episodes[episode_id] = ep
        return ep.secret

    async def drive(self, episode_id: str, row: dict, spec: Any) -> float | None:
        return reward_of(await self.function(row, spec), self.name)

    async def close(self, episode_id: str, why: str, branches: str) -> EpisodeRecord:
        ep = self._episodes.pop(episode_id)
        self.server.remove(ep, why)
        await asyncio.gather(*ep.in_flight, return_exceptions=True)
        return EpisodeRecord.of(ep, branches)

    async def aclose(self) -> None:
        await self.server.close()
