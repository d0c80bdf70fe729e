"""Agents trained unchanged: a user's OpenAI-client agent as an `AgentLoop` over the endpoint.

Two ways in (beside ``rollout.agent.env`` and ``rollout.agent.loop``):

- ``rollout.agent.function: "module:function"``: ``async def agent(row: dict, client: ClientSpec)
  -> float | None``, called once per episode. ``row`` is the dataset row (``prompt``: a text or
  chat messages; ``data_source``, ``reward_model``, ``extra_info``); ``client`` says where to
  point an OpenAI client. It returns the episode's reward, or None: a reward posted to the
  endpoint, else the task's reward function on the final assistant turn.
- ``rollout.agent.command: "python path/agent.py"``: a subprocess per episode (any language) with
  ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``OPENAI_MODEL`` (and ``ASYNCRL_EPISODE_KEY``,
  `ClientSpec.episode_key`) set and the row on stdin as JSON. Its
  reward is posted to the endpoint or printed as its last stdout line; with neither, or a
  non-zero exit (its code and stderr tail are reported), its group fails.

Each episode opens a path on the process's `EndpointServer` (started on the event loop at the
first episode, stopped by `aclose`) whose calls go to the `LLM` the loop got for that response:
in a run, `RolloutLLM`, so pause-keep across a weight sync, per-token versions and partial
rollout apply per call. Each branch of the episode (`asyncrl.agent.endpoint.history`) is a
trajectory: with ``branches="all"`` (``rollout.agent.endpoint_branches``) `run` returns them all
(a list when there are several), the main branch (the branch of its last call) first, the others in
the order they began, each with the episode's reward; with ``"main"`` only the main branch, the
others counted and not trained.
Forks are counted (``agent/http_forks``), their first differing message written to ``forks_path``
(or logged). An episode with no call, or no reward, fails its group (`EpisodeFailed`: the run
goes on).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shlex
import uuid
from dataclasses import dataclass
from typing import Any

from asyncrl.agent.base import LLM, AgentLoop, AgentTrajectory
from asyncrl.agent.endpoint.episode import Episode, EpisodeLimits
from asyncrl.agent.endpoint.server import EndpointServer
from asyncrl.agent.endpoint.tls import share_default_tls_context

log = logging.getLogger("asyncrl.agent.endpoint")
_STDERR_TAIL = 2000


class EpisodeFailed(RuntimeError):
    """An endpoint episode that cannot be trained (no call, no reward, a failed command): fails its
    group with this one-line reason; the run goes on."""


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """Where an agent points its OpenAI client for one episode."""

    base_url: str
    """``{server}/s/{episode}/v1``."""
    api_key: str
    """The episode's secret."""
    model: str
    """The model name to send (any name is served by the policy)."""
    episode_key: str = ""
    """``{sample_id}/{k}`` in a run: the same when the episode runs again after a resume (the URL and
    key are new each time), so a tool with side effects can key them by it (docs/endpoint.md)."""

    @property
    def reward_url(self) -> str:
        """Where a black-box agent posts ``{"reward": x}`` (with the same key)."""
        return self.base_url.removesuffix("/v1") + "/reward"


def row_of(prompt: Any) -> dict:
    """The dataset row an agent gets: a `Prompt`'s messages (or text) and reward meta, in verl's layout."""
    if isinstance(prompt, dict):
        return prompt
    if isinstance(prompt, str):
        return {"prompt": prompt}
    meta = dict(getattr(prompt, "meta", None) or {})
    row = {"prompt": getattr(prompt, "messages", None) or getattr(prompt, "text", "")}
    row.update(data_source=meta.get("data_source"), reward_model={"ground_truth": meta.get("ground_truth")},
               extra_info=meta.get("extra_info") or {})
    return row


class EndpointLoop(AgentLoop):
    """Run ``function`` or ``command`` per episode against the endpoint (the module docstring)."""

    def __init__(self, tokenizer: Any, *, function: Any = None, command: str | None = None,
                 limits: EpisodeLimits | None = None, host: str = "127.0.0.1", port: int = 0, model: str = "policy",
                 forks_path: str | None = None, name: str = "endpoint agent", renderer: Any = None,
                 branches: str = "all"):
        from asyncrl.agent.render import ChatRenderer

        if (function is None) == (command is None):
            raise ValueError("EndpointLoop: give a function or a command, one of them")
        if branches not in ("all", "main"):
            raise ValueError(f"EndpointLoop: branches must be all or main (rollout.agent.endpoint_branches), got {branches!r}")
        self.branches = branches
        self.function, self.command, self.name = function, command, name
        self.renderer = renderer or ChatRenderer(tokenizer)
        self.limits = limits or EpisodeLimits()
        self.server = EndpointServer(host, port)
        self.model, self.forks_path = model, forks_path
        self._started: asyncio.Lock | None = None
        self._up = False
        self.counts = {"episodes": 0, "http_calls": 0, "http_forks": 0, "http_failed_episodes": 0,
                       "http_trajectories": 0, "turns": 0, "tool_calls": 0, "http_tool_call_turns": 0,
                       "http_limit_ended": 0}
        """Totals (reported as ``agent/*``): trajectories returned (branches trained); answers sampled
        (``turns``), the tool calls they carried (``tool_calls``, as an env loop's: the step's
        ``agent/tool_calls_per_turn`` needs no transcript parsing) and answers that carried any."""

    async def start(self) -> EndpointServer:
        """The server, started on this event loop at the first call."""
        if self._started is None:
            self._started = asyncio.Lock()
        async with self._started:
            if not self._up:
                if self.function is not None:  # it builds its HTTP clients in this process
                    share_default_tls_context()
                await self.server.start()
                self._up = True
        return self.server

    async def aclose(self) -> None:
        if self._up:
            self._up = False
            await self.server.close()

    async def run(self, prompt: Any, llm: LLM) -> AgentTrajectory | list[AgentTrajectory]:
        server = await self.start()
        if hasattr(llm, "abort_on_cancel"):
            llm.abort_on_cancel = True  # a call given up (client gone, episode ended) aborts its engine request
        base = str(getattr(llm, "episode_id", None) or "episode").replace("/", "-")
        ep = Episode(f"{base}-{uuid.uuid4().hex[:8]}", llm, self.renderer, self.limits, self.model)
        server.add(ep)
        self.counts["episodes"] += 1
        spec = ClientSpec(server.base_url(ep), ep.secret, self.model, str(getattr(llm, "episode_id", None) or ep.id))
        try:
            # (``asyncio.timeout``, not ``wait_for``: the agent runs in this task, not in one more Task with
            # its waiter, callbacks and context per live episode, which every collection of the young
            # generations would walk while the episode lasts)
            async with asyncio.timeout(self.limits.max_episode_s):
                reward = await self._drive(row_of(prompt), spec)
        except TimeoutError:
            self.counts["http_failed_episodes"] += 1
            raise EpisodeFailed(f"episode {ep.id} ran past rollout.agent.endpoint_max_episode_s="
                                f"{self.limits.max_episode_s}") from None
        except Exception as e:
            if ep.limit_hit is None:
                raise
            # The endpoint refused a call past the run's limit and the agent's client raised on the 400
            # (most stacks do not catch it). A policy that talks past its budget is what RL trains away,
            # not an error in the agent's code: the episode ends with what was answered, scored as an
            # episode that returned None (its posted reward, else the task's reward function).
            self.counts["http_limit_ended"] += 1
            log.debug("episode %s ended at %s: the agent raised %s", ep.id, ep.limit_hit, type(e).__name__)
            reward = None
        finally:
            server.remove(ep, "the agent returned")
            await asyncio.gather(*ep.in_flight, return_exceptions=True)
            self.counts["http_calls"] += ep.calls
            self.counts["turns"] += sum(b.calls for b in ep.history.branches)
            self.counts["tool_calls"] += ep.tool_calls
            self.counts["http_tool_call_turns"] += ep.tool_call_turns
        return self._trajectory(ep, reward)

    async def _drive(self, row: dict, spec: ClientSpec) -> float | None:
        if self.function is not None:
            out = await self.function(row, spec)
            if out is not None and (isinstance(out, bool) or not isinstance(out, (int, float))):
                raise TypeError(f"{self.name} must return a float reward or None, got {type(out).__name__}")
            return None if out is None else float(out)
        return await run_command(self.command, row, spec)

    def _trajectory(self, ep: Episode, returned: float | None) -> AgentTrajectory | list[AgentTrajectory]:
        history = ep.history
        self.counts["http_forks"] += history.forks
        if history.forks:
            self._report_forks(ep)
        if history.last is None:
            self.counts["http_failed_episodes"] += 1
            made = f"its {ep.calls} call(s) ended without an answer" if ep.calls else "it made no call to its endpoint"
            raise EpisodeFailed(f"episode {ep.id} of {self.name}: nothing to train ({made})")
        reward = returned if returned is not None else ep.reward
        if reward is None and self.command is not None and ep.limit_hit is None:
            self.counts["http_failed_episodes"] += 1
            raise EpisodeFailed(f"episode {ep.id}: {self.name} gave no reward (post it to /s/<episode>/reward or "
                                "print it as the last stdout line)")
        if self.branches == "main":
            self.counts["http_trajectories"] += 1
            return history.last.trajectory(reward)
        branches = [history.last, *(b for b in history.branches if b is not history.last)]
        self.counts["http_trajectories"] += len(branches)
        out = [b.trajectory(reward) for b in branches]
        return out if len(out) > 1 else out[0]

    def _report_forks(self, ep: Episode) -> None:
        for index, message in ep.history.divergences:
            record = {"episode": ep.id, "message_index": index, "message": message}
            if self.forks_path:
                with open(self.forks_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(record, default=str) + "\n")
            else:
                log.warning("endpoint fork: %s", json.dumps(record, default=str)[:2000])


async def run_command(command: str, row: dict, spec: ClientSpec) -> float | None:
    """One episode as a subprocess (the module docstring): its reward printed, else None."""
    env = {**os.environ, "OPENAI_BASE_URL": spec.base_url, "OPENAI_API_KEY": spec.api_key, "OPENAI_MODEL": spec.model,
           "ASYNCRL_REWARD_URL": spec.reward_url, "ASYNCRL_EPISODE_KEY": spec.episode_key}
    proc = await asyncio.create_subprocess_exec(*shlex.split(command), stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        out, err = await proc.communicate(json.dumps(row).encode())
    finally:
        if proc.returncode is None:  # cancelled (the episode's wall time, a stop): the process goes with it
            proc.kill()
            await proc.wait()
    if proc.returncode != 0:
        tail = err.decode(errors="replace")[-_STDERR_TAIL:].strip()
        raise EpisodeFailed(f"rollout.agent.command {command!r} exited with code {proc.returncode}: {tail}")
    lines = out.decode(errors="replace").strip().splitlines()
    if lines:
        try:
            value = float(lines[-1].strip())
        except ValueError:
            return None
        if math.isfinite(value):
            return value
    return None
