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

Each episode opens a path on the endpoint's server (`asyncrl.agent.endpoint.host`: in a process of
its own, or on this event loop; started at the first episode, stopped by `aclose`) whose calls go
to the `LLM` the loop got for that response:
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
from asyncrl.agent.endpoint.episode import EpisodeLimits
from asyncrl.agent.endpoint.host import HOSTS, EndpointHost, EpisodeRecord, HostGone, LoopHost, reward_of
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
    """Run ``function`` or ``command`` per episode against the endpoint (the module docstring).

    ``server``: where the endpoint serves (`asyncrl.agent.endpoint.host`): ``loop`` (this event
    loop; the default of a loop built by hand, as in tests and benches) or ``process`` (a process
    of its own; a run's default, ``rollout.agent.endpoint_server``).

    ``function_in``: where ``function`` runs. ``endpoint`` (the default): next to the endpoint's
    server, in its process with ``process``, so the agent's client (its HTTP, its parsing) spends no
    CPU in the Rollouter's process, where it held up the engines; the function then crosses to that
    process by reference (a module's function) or by value (a closure, with copies of what it
    holds). ``caller``: on this event loop (an agent that must share this process's objects, as the
    bench's hand-off to its own clients' process)."""

    def __init__(self, tokenizer: Any, *, function: Any = None, command: str | None = None,
                 limits: EpisodeLimits | None = None, host: str = "127.0.0.1", port: int = 0, model: str = "policy",
                 forks_path: str | None = None, name: str = "endpoint agent", renderer: Any = None,
                 branches: str = "all", server: str = "loop", function_in: str = "endpoint"):
        from asyncrl.agent.render import ChatRenderer

        if (function is None) == (command is None):
            raise ValueError("EndpointLoop: give a function or a command, one of them")
        if branches not in ("all", "main"):
            raise ValueError(f"EndpointLoop: branches must be all or main (rollout.agent.endpoint_branches), got {branches!r}")
        self.branches = branches
        self.function, self.command, self.name = function, command, name
        self.renderer = renderer or ChatRenderer(tokenizer)
        self.limits = limits or EpisodeLimits()
        if server not in HOSTS:
            raise ValueError(f"EndpointLoop: server must be loop or process (rollout.agent.endpoint_server), got {server!r}")
        if function_in not in ("endpoint", "caller"):
            raise ValueError(f"EndpointLoop: function_in must be endpoint or caller, got {function_in!r}")
        hosted = {"function": function if function_in == "endpoint" else None, "name": name}
        if server == "process":
            from asyncrl.agent.endpoint.process import ProcessHost

            self.host: EndpointHost = ProcessHost(self.renderer, self.limits, model, host, port, **hosted)
        else:
            self.host = LoopHost(self.renderer, self.limits, model, host, port, **hosted)
        self.model, self.forks_path = model, forks_path
        self._started: asyncio.Lock | None = None
        self._up = False
        self.counts = {"episodes": 0, "http_calls": 0, "http_forks": 0, "http_failed_episodes": 0,
                       "http_trajectories": 0, "turns": 0, "tool_calls": 0, "http_tool_call_turns": 0,
                       "http_limit_ended": 0}
        """Totals (reported as ``agent/*``): trajectories returned (branches trained); answers sampled
        (``turns``), the tool calls they carried (``tool_calls``, as an env loop's: the step's
        ``agent/tool_calls_per_turn`` needs no transcript parsing) and answers that carried any."""

    async def start(self) -> EndpointHost:
        """The endpoint's host, started at the first call (its server on this event loop, or its process)."""
        if self._started is None:
            self._started = asyncio.Lock()
        async with self._started:
            if not self._up:
                if self.function is not None and self.host.function is None:  # it builds its HTTP clients here
                    share_default_tls_context()
                await self.host.start()
                self._up = True
        return self.host

    async def aclose(self) -> None:
        if self._up:
            self._up = False
            await self.host.aclose()

    async def run(self, prompt: Any, llm: LLM) -> AgentTrajectory | list[AgentTrajectory]:
        host = await self.start()
        if hasattr(llm, "abort_on_cancel"):
            llm.abort_on_cancel = True  # a call given up (client gone, episode ended) aborts its engine request
        base = str(getattr(llm, "episode_id", None) or "episode").replace("/", "-")
        episode_id = f"{base}-{uuid.uuid4().hex[:8]}"
        try:
            secret = await host.open(episode_id, llm)
        except HostGone as e:
            self.counts["http_failed_episodes"] += 1
            raise EpisodeFailed(f"episode {episode_id}: {e}") from None
        self.counts["episodes"] += 1
        spec = ClientSpec(host.base_url(episode_id), secret, self.model, str(getattr(llm, "episode_id", None) or episode_id))
        reward: float | None = None
        failure: Exception | None = None
        try:
            # (``asyncio.timeout``, not ``wait_for``: the agent runs in this task, not in one more Task with
            # its waiter, callbacks and context per live episode, which every collection of the young
            # generations would walk while the episode lasts)
            async with asyncio.timeout(self.limits.max_episode_s):
                reward = await self._drive(episode_id, row_of(prompt), spec)
        except Exception as e:
            failure = e
        finally:
            try:
                record: EpisodeRecord | HostGone = await host.close(episode_id, "the agent returned", self.branches)
            except HostGone as e:
                record = e  # (raised below: not from here, where it would replace a cancellation)
            else:
                self.counts["http_calls"] += record.calls
                self.counts["turns"] += record.turns
                self.counts["tool_calls"] += record.tool_calls
                self.counts["http_tool_call_turns"] += record.tool_call_turns
        if isinstance(record, HostGone):
            self.counts["http_failed_episodes"] += 1
            raise EpisodeFailed(f"episode {episode_id}: {record}") from None
        if isinstance(failure, TimeoutError):
            self.counts["http_failed_episodes"] += 1
            raise EpisodeFailed(f"episode {episode_id} ran past rollout.agent.endpoint_max_episode_s="
                                f"{self.limits.max_episode_s}") from None
        if failure is not None:
            if record.limit_hit is None:
                raise failure
            # The endpoint refused a call past the run's limit and the agent's client raised on the 400
            # (most stacks do not catch it). A policy that talks past its budget is what RL trains away,
            # not an error in the agent's code: the episode ends with what was answered, scored as an
            # episode that returned None (its posted reward, else the task's reward function).
            self.counts["http_limit_ended"] += 1
            log.debug("episode %s ended at %s: the agent raised %s", episode_id, record.limit_hit, type(failure).__name__)
            reward = None
        return self._trajectory(record, reward)

    async def _drive(self, episode_id: str, row: dict, spec: ClientSpec) -> float | None:
        if self.host.function is not None:
            return await self.host.drive(episode_id, row, spec)
        if self.function is not None:
            return reward_of(await self.function(row, spec), self.name)
        return await run_command(self.command, row, spec)

    def _trajectory(self, record: EpisodeRecord, returned: float | None) -> AgentTrajectory | list[AgentTrajectory]:
        self.counts["http_forks"] += record.forks
        if record.forks:
            self._report_forks(record)
        if not record.trajectories:
            self.counts["http_failed_episodes"] += 1
            made = f"its {record.calls} call(s) ended without an answer" if record.calls else "it made no call to its endpoint"
            raise EpisodeFailed(f"episode {record.id} of {self.name}: nothing to train ({made})")
        reward = returned if returned is not None else record.reward
        if reward is None and self.command is not None and record.limit_hit is None:
            self.counts["http_failed_episodes"] += 1
            raise EpisodeFailed(f"episode {record.id}: {self.name} gave no reward (post it to /s/<episode>/reward or "
                                "print it as the last stdout line)")
        self.counts["http_trajectories"] += len(record.trajectories)
        for t in record.trajectories:
            t.reward = reward
        return record.trajectories if len(record.trajectories) > 1 else record.trajectories[0]

    def _report_forks(self, record: EpisodeRecord) -> None:
        for index, message in record.divergences:
            row = {"episode": record.id, "message_index": index, "message": message}
            if self.forks_path:
                with open(self.forks_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row, default=str) + "\n")
            else:
                log.warning("endpoint fork: %s", json.dumps(row, default=str)[:2000])


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
