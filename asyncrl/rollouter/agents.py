"""Agent loops in the Rollouter: each response of a group is one run of the configured loop.

``rollout.agent.env=module:Class`` runs asyncrl's `EnvLoop` over that `Env` (one instance per
episode, rendered with the model's chat template); ``rollout.agent.loop=module:Class`` runs a
user's `AgentLoop` (one instance per process); ``rollout.agent.function`` / ``command`` run an
OpenAI-client agent per episode against its own endpoint (`asyncrl.agent.endpoint.EndpointLoop`,
an `AgentLoop` too; its server is stopped by `Agent.aclose`). `build_agent` makes either from the config in the
Rollouter's process (`RolloutWorker`); the Rollouter's `_one_response` hands each response to
`run_agent_response` when one is configured.

- Every turn is one engine request through the group's `GroupCalls`: the group's replica, request
  id ``{sample_id}/{k}/t{turn}`` (``/{age}`` after a truncation), a seed derived from the
  response's own (`turn_seed`), and ``session_id={sample_id}/{k}`` (``/s{j}`` for the j-th
  conversation a loop opens after the first), so an engine may keep the conversation's KV between
  turns; each session is ended on the engines (`end_session`) when the run ends, however it ends.
  The run's state (turns, sessions, the turn in flight, age, replica, status, then its episodes and
  rewards) is one `asyncrl.rollouter.response.Conversation` record; `RolloutLLM` keeps none of its own.
- Partial rollout truncates a turn like a response (`asyncrl.rollouter.resumable`): the turn waits
  for the next round and resumes from its prompt + partial turn; its later tokens carry the new
  version. A weight sync between turns (during a tool call) simply means the next turn is
  generated on the new weights. Truncated turns are not saved in the checkpoint: a conversation in
  flight at a crash is generated again from its start (exactly once per prompt; its tools run
  again, with the same call keys: ``call_key``, `asyncrl.agent.tool_env`).
- Reward: the env's (the last `Step.reward`), else the task's reward function on the ids of the
  episode's last model turn (the last run of ``loss_mask`` 1; nothing when there is none).
- Sessions: every run of the loop must return ``rollout.agent.sessions`` trajectories (default 1);
  response ``k``'s session ``s`` is trajectory ``k * sessions + s`` of a group of ``n * sessions``.
  An endpoint agent's run returns one trajectory per branch of its episode (``endpoint_branches=all``,
  `Agent.branches`), main branch first, each with the episode's reward (the main branch's when the
  task's reward function scores it): `flatten_runs` numbers the group's trajectories in response
  order and records each one's episode (`asyncrl.types.EPISODES_KEY`), so that the Trainer takes
  advantages per episode; the group holds as many trajectories as the episodes had branches.
  Another count is the loop's error (`SessionCountError`), as is a loop or env that raises
  (`AgentLoopError`, naming it, the error and the prompt): both are `UserCodeError`s, which
  ``rollout.on_user_error`` stops the run on or drops the group for (`asyncrl.usercode`); an
  engine's error passes through unchanged and fails the group.
- Validation (``data.val``) runs the same loop on each validation prompt, greedily, on one replica
  (`validate_agent_response`: request ids ``val_{step}_{i}/t{turn}``), scored as in training.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl.agent.base import Turn
from asyncrl.agent.llm import SessionLLM
from asyncrl.calls import call_within
from asyncrl.rollouter.config import AgentConfig, RolloutConfig
from asyncrl.rollouter.partial import PartialResponse
from asyncrl.rollouter.pool import GroupCalls
from asyncrl.rollouter.response import Conversation, Ended
from asyncrl.rollouter.rewards import Pending, Rewards, score
from asyncrl.rollouter.resumable import Rounds, generate_resumable
from asyncrl.usercode import UserCodeError
from asyncrl.types import GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from asyncrl.agent import AgentLoop
    from asyncrl.rollouter.feed import Prompt

log = logging.getLogger("asyncrl.rollouter")


class AgentLoopError(UserCodeError):
    """The agent loop (or its env) raised while running one response (a user error)."""


class SessionCountError(UserCodeError):
    """A run of the agent loop returned another number of trajectories than ``rollout.agent.sessions``."""


@dataclass
class Agent:
    """The configured loop of one Rollouter process."""

    loop: AgentLoop
    name: str
    """What the config named (``rollout.agent.env=...`` / ``rollout.agent.loop=...``), for errors."""
    sessions: int = 1
    # Keyword-only: given by position, a runner once landed in ``branches`` (never closed, and an
    # env's responses taken for an endpoint episode's branches).
    branches: bool = field(default=False, kw_only=True)
    """A run returns one or more trajectories (an endpoint episode's branches), not ``sessions``."""
    runner: Any = field(default=None, kw_only=True)
    """The `ToolRunner` every `ToolEnv` episode shares (None: no env); `close` stops it."""

    def __post_init__(self) -> None:
        if type(self.loop).__name__ == "EndpointLoop" and getattr(self.loop, "branches", None) == "all":
            self.branches = True  # however the Agent was built (a bench builds its own)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()

    async def aclose(self) -> None:
        """`close`, and stop what the loop serves on the event loop (an endpoint agent's HTTP server)."""
        if hasattr(self.loop, "aclose"):
            await self.loop.aclose()
        self.close()


def build_agent(cfg: AgentConfig, tokenizer: Any) -> Agent | None:
    """The loop ``cfg`` names (None: plain generation). Raises `AgentSpecError` for bad paths."""
    from asyncrl.agent import EnvLoop, ToolEnv, ToolRunner, load_agent_loop_class, load_env_class

    if cfg.loop is not None:
        return Agent(load_agent_loop_class(cfg.loop)(**cfg.kwargs), f"rollout.agent.loop={cfg.loop}", cfg.sessions)
    if cfg.endpoint:
        from asyncrl.agent.endpoint.config import build_endpoint_loop

        return Agent(build_endpoint_loop(cfg, tokenizer), cfg.spec)  # branches: from the loop
    if cfg.env is None:
        return None
    env_class = load_env_class(cfg.env)
    runner = ToolRunner(cfg)  # an AgentConfig is a ToolRunnerConfig and an EnvLoopConfig, checked once
    kwargs = dict(cfg.kwargs)

    def make_env():
        env = env_class(**kwargs)
        if isinstance(env, ToolEnv):
            env.share_runner(runner)  # one bound and one thread pool for every episode of the process
        return env

    loop = EnvLoop(make_env, tokenizer, cfg)
    return Agent(loop, f"rollout.agent.env={cfg.env}", runner=runner)


def turn_seed(response_seed: int, turn: int, age: int) -> int:
    """Turn ``turn`` of a response (after ``age`` truncations): distinct, reproducible seeds."""
    return response_seed + 7919 * age + 104729 * turn


def _on_record(name: str, doc: str) -> property:
    """An attribute of `SessionLLM` kept in the conversation's record, not on the adapter."""
    return property(lambda llm: getattr(llm.record, name), lambda llm, value: setattr(llm.record, name, value), doc=doc)


class RolloutLLM(SessionLLM):
    """The `LLM` one response's loop talks to: each turn a request through the group's calls.

    A loop that runs several conversations for one prompt calls `session` for each after the
    first; turns then go under that session's id. ``cfg`` gives the sampling settings, ``rounds``
    partial rollout's rounds (`generate_resumable`). Its state (turns, sessions, the turn in
    flight, age, replica, the engine's error) is ``record``'s (`Conversation`), not its own.
    """

    turns = _on_record("turns", "Turns asked for so far.")
    session_id = _on_record("session_id", "The session later turns go under.")
    sessions = _on_record("sessions", "Every session opened, ended when the run ends.")

    def __init__(self, cfg: RolloutConfig, rounds: Rounds, calls: GroupCalls, record: Conversation, seed: int):
        self.record = record
        super().__init__(record.id)
        self.cfg, self.rounds, self.calls, self.seed = cfg, rounds, calls, seed
        self.abort_on_cancel = False
        """A turn cancelled by its loop aborts its engine request (an endpoint agent sets it: a client
        that disconnects gives its call up); otherwise a cancel is the group's and `Rollouter.stop` aborts."""

    def _next_turn(self) -> int:  # straight on the record, not through the properties: once per turn
        record = self.record
        turn = record.turns
        record.turns = turn + 1
        return turn

    async def generate(self, token_ids, *, max_tokens: int, stop: tuple[int, ...] = ()) -> Turn:
        cfg, record, turn = self.cfg, self.record, self._next_turn()
        prompt_ids = np.asarray(token_ids, dtype=np.int64)
        session_id = record.session_id

        def make_request(parts: PartialResponse) -> GenerateRequest:
            ids, _, _ = parts.joined()
            return GenerateRequest(
                request_id=f"{self.base}/t{turn}" + (f"/{parts.age}" if parts.age else ""),
                prompt_ids=np.concatenate([prompt_ids, ids]) if len(ids) else prompt_ids,
                max_tokens=max_tokens - len(ids), session_id=session_id,
                sampling=SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                        stop_token_ids=tuple(stop), seed=turn_seed(self.seed, turn, parts.age)))

        parts = record.parts = PartialResponse()
        sent: list[str] = []
        try:
            result, record.replica = await generate_resumable(
                self.rounds, self.calls, lambda p: _noted(make_request(p), sent), record, max_tokens)
        except asyncio.CancelledError:
            if self.abort_on_cancel:  # the loop gave the turn up (an endpoint client went away): free the engine
                await self._abort(sent[-1:])
            raise
        except Exception as exc:
            record.engine_error = exc  # the engine's error, not the loop's: it passes through unchanged
            raise
        record.age += parts.age
        ids, logprobs, versions = parts.joined()
        finish = result.finish_reason if result.finish_reason != "truncated" else "length"
        return Turn(ids, logprobs, versions, finish)

    async def _abort(self, request_ids: list[str]) -> None:
        """Abort a cancelled turn's request on the replica it went to (a no-op for one that never went out)."""
        if request_ids and self.record.replica >= 0:
            try:
                await call_within(self.calls.pool.handle(self.record.replica), "abort", 10.0, request_ids)
            except Exception as exc:  # noqa: BLE001 - the engine may be gone, and the request with it
                log.debug("abort(%s) failed: %r", request_ids, exc)

    async def end_sessions(self) -> None:
        """Let the engine its turns went to drop what it keeps for this response's conversations (a
        no-op where it keeps nothing, or where no turn went out)."""
        if self.record.replica >= 0:
            await end_sessions(self.calls.pool.handle(self.record.replica), self.record.sessions)


def _noted(request: GenerateRequest, sent: list[str]) -> GenerateRequest:
    sent.append(request.request_id)
    return request


async def end_sessions(engine: Any, session_ids: list[str]) -> None:
    """``end_session`` on ``engine`` for each id; an engine that is gone took its KV with it."""
    for session_id in session_ids:
        try:
            await call_within(engine, "end_session", 10.0, session_id)
        except Exception as exc:  # noqa: BLE001 - the engine may be gone; its KV went with it
            log.debug("end_session(%s) failed: %r", session_id, exc)


class ValidationLLM(SessionLLM):
    """The `LLM` of one validation conversation: greedy turns on one replica, request ids
    ``{request_id}/t{turn}`` under the session ``{request_id}`` (``/s{j}`` for a multi-output
    loop's later conversations), each under the request deadline. Never truncated: validation
    runs outside the rounds of partial rollout."""

    def __init__(self, engine: Any, request_id: str, timeout_s: float):
        super().__init__(request_id)
        self.engine, self.timeout_s = engine, timeout_s

    async def generate(self, token_ids, *, max_tokens: int, stop: tuple[int, ...] = ()) -> Turn:
        request = GenerateRequest(request_id=f"{self.base}/t{self._next_turn()}",
                                  prompt_ids=np.asarray(token_ids, np.int64), max_tokens=max_tokens,
                                  session_id=self.session_id, sampling=SamplingParams(greedy=True, stop_token_ids=tuple(stop)))
        return self._turn(await call_within(self.engine, "generate", self.timeout_s, request))


async def validate_agent_response(agent: Agent, engine: Any, request_id: str, prompt: Prompt, reward_fn: Any,
                                  timeout_s: float) -> list[tuple[float, int, int]]:
    """One greedy run of the loop for a validation prompt: (reward, response tokens, model turns)
    of each trajectory it returns. The reward as in training: the env's, else ``reward_fn`` on the
    last model turn. A loop that raises fails the validation with `AgentLoopError`, naming it."""
    llm = ValidationLLM(engine, request_id, timeout_s)
    try:
        out = await agent.loop.run(prompt, llm)
    except Exception as exc:
        raise AgentLoopError(f"{agent.name} raised {type(exc).__name__} on validation prompt {request_id}: {exc}") from exc
    finally:
        await end_sessions(engine, llm.sessions)
    scored = []
    out = out if isinstance(out, (list, tuple)) else [out]
    for ep in out[:1] if agent.branches else out:  # an episode's branches are not several answers
        reward = ep.reward
        if reward is None:
            ids = last_turn(np.asarray(ep.response_ids), np.asarray(ep.loss_mask))
            reward = await score(reward_fn, prompt, ids)
        scored.append((float(reward), len(ep.response_ids), int(ep.turns)))
    return scored


async def run_agent_response(agent: Agent, sample_id: str, k: int, prompt: Prompt, calls: GroupCalls, seed: int, *,
                             cfg: RolloutConfig, rounds: Rounds, rewards: Rewards) -> list[Ended]:
    """Response ``k`` as one run of the loop: its trajectories (``agent.sessions`` of them), each
    `Ended` with the replica of its last turn and its reward under way (started on ``rewards``;
    none for an episode whose env gave one)."""
    record = Conversation(sample_id, k)
    llm = RolloutLLM(cfg, rounds, calls, record, seed)
    try:
        out = await agent.loop.run(prompt, llm)
    except Exception as exc:
        if exc is record.engine_error or type(exc).__name__ == "EpisodeFailed":  # (an endpoint episode: fails its group)
            raise
        raise AgentLoopError.of(exc, agent.name, sample_id, getattr(prompt, "text", None)) from exc
    finally:
        await llm.end_sessions()
    episodes = out if isinstance(out, (list, tuple)) else [out]
    if agent.branches and episodes:  # one episode's branches: the main one's reward is everyone's
        return record.finish(episodes, [_reward(rewards, prompt, episodes[0])] * len(episodes), first=0)
    if len(episodes) != agent.sessions:
        raise SessionCountError(f"{sample_id}/{k}: {agent.name} returned {len(episodes)} trajectories, "
                                f"rollout.agent.sessions={agent.sessions}", where=agent.name, sample_id=sample_id,
                                prompt=getattr(prompt, "text", None))
    return record.finish(episodes, [_reward(rewards, prompt, ep) for ep in episodes], first=k * agent.sessions)


def flatten_runs(agent: Agent | None, outcomes: list) -> tuple[list, list[int] | None]:
    """The group's entries in one list (a run of a loop gives a list, one per session or branch; an
    error stays one entry) and, for an agent with branches, each trajectory's response (episode):
    its trajectories are numbered ``0..`` in response order (`asyncrl.types.EPISODES_KEY`)."""
    if agent is None:
        return outcomes, None
    flat, episodes = [], []
    for k, o in enumerate(outcomes):
        for x in o if isinstance(o, list) else [o]:
            if agent.branches and isinstance(x, Ended):
                x = x.renumbered(len(episodes))
                episodes.append(k)
            flat.append(x)
    return flat, episodes if agent.branches else None


def first_of_episodes(entries: list, episodes: list[int] | None) -> list:
    """``entries`` (all trajectories) less the later branches of each episode."""
    if episodes is None:
        return entries
    return [x for i, x in enumerate(entries) if i == 0 or episodes[i] != episodes[i - 1]]


def _reward(rewards: Rewards, prompt: Prompt, episode: Any) -> Pending | None:
    """None when the env gave a reward (it is in the episode), else the task's reward of the last
    model turn, started."""
    if episode.reward is not None:
        return None
    return rewards.start(prompt, last_turn(np.asarray(episode.response_ids), np.asarray(episode.loss_mask)))


def last_turn(response_ids: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """The ids of the last run of ``loss_mask`` 1 (the last model turn); empty when there is none."""
    model = np.flatnonzero(loss_mask)
    if not len(model):
        return response_ids[:0]
    end = model[-1] + 1
    observed = np.flatnonzero(loss_mask[:end] == 0)
    start = observed[-1] + 1 if len(observed) else 0
    return response_ids[start:end]


def check_agent(cfg: AgentConfig, model_path: str) -> None:
    """The launcher's preflight, before Ray starts: the path imports and is an `Env` (``reset``,
    ``step``) or an `AgentLoop` (``run``); the class builds with ``rollout.agent.kwargs`` (a `ToolEnv`'s tools
    with type hints and descriptions); a `ToolEnv` gets a tokenizer whose chat template shows
    tools. Raises `AgentSpecError`, one line each."""
    from asyncrl.agent import AgentSpecError, ToolEnv, check_tool_template, load_agent_loop_class, load_env_class

    if cfg.endpoint:
        from asyncrl.agent.endpoint.config import check_endpoint_agent

        return check_endpoint_agent(cfg)
    field, path = ("rollout.agent.loop", cfg.loop) if cfg.loop is not None else ("rollout.agent.env", cfg.env)
    if path is None:
        return
    cls = load_agent_loop_class(path) if cfg.loop is not None else load_env_class(path)
    if isinstance(cls, type) and issubclass(cls, ToolEnv):
        from asyncrl.models import load_tokenizer

        check_tool_template(load_tokenizer(model_path), field=f"{field}={path} with model {model_path}")
    args = ", ".join(f"{k}={v!r}" for k, v in cfg.kwargs.items())
    try:
        built = cls(**cfg.kwargs)
    except Exception as e:  # noqa: BLE001 - the user's constructor; reported in one line
        given = f"with rollout.agent.kwargs ({args})" if args else "with no arguments (rollout.agent.kwargs is empty)"
        raise AgentSpecError(f"{field}={path!r}: {cls.__name__}({args}) fails ({type(e).__name__}: {e}); the "
                             f"Rollouter builds it {given}") from None
    if hasattr(built, "close"):
        asyncio.run(built.close())
