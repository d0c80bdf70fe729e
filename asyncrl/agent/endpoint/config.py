"""From ``rollout.agent.function`` / ``command`` to an `EndpointLoop`, and the launcher's check of them.

The limits of an episode reuse the agent settings an env loop has: ``rollout.agent.max_turns``
(calls per episode), ``max_tokens_per_turn`` (a call's ``max_tokens`` at most),
``max_context_tokens`` (a branch's prompt + response tokens); the wall time is
``rollout.agent.endpoint_max_episode_s``.
"""

from __future__ import annotations

import inspect
import shlex
import shutil
from pathlib import Path
from typing import Any

from asyncrl.agent.endpoint.episode import EpisodeLimits
from asyncrl.agent.endpoint.loop import EndpointLoop
from asyncrl.agent.loading import AgentSpecError, load_object


def limits_of(cfg: Any) -> EpisodeLimits:
    """The `EpisodeLimits` of an `AgentConfig`."""
    return EpisodeLimits(max_calls=cfg.max_turns, max_context_tokens=cfg.max_context_tokens,
                         max_tokens_per_call=cfg.max_tokens_per_turn, max_episode_s=cfg.endpoint_max_episode_s)


def load_agent_function(path: str) -> Any:
    """The ``async def agent(row, client)`` at ``path``; `AgentSpecError` in one line otherwise."""
    field = "rollout.agent.function"
    fn = load_object(path, field=field)
    if not inspect.iscoroutinefunction(fn):
        raise AgentSpecError(f"{field}={path!r}: is not an 'async def' function; an endpoint agent is "
                             "async def agent(row: dict, client: ClientSpec) -> float | None")
    try:
        inspect.signature(fn).bind({}, None)
    except TypeError:
        raise AgentSpecError(f"{field}={path!r}: {fn.__name__}{inspect.signature(fn)} cannot be called as "
                             "agent(row, client)") from None
    return fn


def check_command(command: str) -> None:
    """The command's program exists (on PATH or as a file) and a script it names as its first argument too."""
    field = "rollout.agent.command"
    try:
        argv = shlex.split(command)
    except ValueError as e:
        raise AgentSpecError(f"{field}={command!r}: cannot be split into arguments ({e})") from None
    if not argv:
        raise AgentSpecError(f"{field} is empty: give the command line that runs one episode")
    if shutil.which(argv[0]) is None:
        raise AgentSpecError(f"{field}={command!r}: {argv[0]!r} is not an executable (not on PATH, not a file)")
    script = next((a for a in argv[1:] if not a.startswith("-")), None)
    if script is not None and Path(argv[0]).name.startswith("python") and script.endswith(".py") \
            and not Path(script).is_file():
        raise AgentSpecError(f"{field}={command!r}: the script {script!r} does not exist")


def check_endpoint_agent(cfg: Any) -> None:
    """The launcher's preflight for ``function`` / ``command`` (before Ray starts)."""
    if cfg.function is not None:
        load_agent_function(cfg.function)
    else:
        check_command(cfg.command)


def build_endpoint_loop(cfg: Any, tokenizer: Any) -> EndpointLoop:
    """The `EndpointLoop` an `AgentConfig` names (its server starts at the first episode)."""
    function = load_agent_function(cfg.function) if cfg.function is not None else None
    return EndpointLoop(tokenizer, function=function, command=cfg.command, limits=limits_of(cfg),
                        host=cfg.endpoint_host, port=cfg.endpoint_port, model=cfg.endpoint_model,
                        forks_path=cfg.endpoint_forks_path, name=cfg.spec,
                        branches=cfg.endpoint_branches, server=cfg.endpoint_server)
