"""The built-in agent loops: `EnvLoop` (an `Env` drives the conversation) and `SingleTurnLoop`
(plain generation: one turn, no env).

`EnvLoop.run(prompt, llm)`:

1. ``env.reset(prompt)`` -> messages, rendered once with the chat template (tools shown) into
   the prompt ids;
2. a turn: ``llm.generate(all ids so far, max_tokens=..., stop=end-of-turn)``; its exact token
   ids are appended with ``loss_mask`` 1 and their behaviour log-probs and versions;
3. ``env.step(turn text)`` -> `Step`; unless the episode ends, only the observation (with the
   template's markers around it) is tokenized and appended, ``loss_mask`` 0, log-prob 0,
   version -1; then back to 2.

Finish reasons: ``stop`` (the env said done), ``length`` (a turn used its whole
``max_tokens_per_turn``), ``max_turns`` (the env was not done after ``max_turns`` turns),
``context`` (the next turn or observation would not fit ``max_context_tokens``), and the
engine's ``abort`` / ``truncated`` passed through. ``step`` is called for every finished turn,
the last included, so the env's reward covers it. An observation that does not fit is not
appended: a trajectory never ends on tokens nobody reads.

In a run, the Rollouter builds this loop from ``rollout.agent.*`` and gives it an `LLM` whose
turns are requests of the group (`asyncrl.rollouter.agents`): a truncated turn resumes there,
so ``truncated`` never reaches this loop from the Rollouter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from asyncrl.agent.base import OBSERVATION_VERSION, LLM, AgentLoop, AgentTrajectory, Env, Step, Turn
from asyncrl.agent.limits import EnvLoopConfig
from asyncrl.agent.render import ChatRenderer, PlainRenderer


class _Episode:
    """The growing trajectory of one `EnvLoop.run`. Its tokens and per-token fields are kept as
    arrays (a list of Python ints per token is a container the garbage collector walks, for
    each of a thousand live conversations, in every young collection)."""

    def __init__(self, prompt_ids: Any):
        self.context = np.asarray(prompt_ids, np.int64)
        """The prompt and everything after it, as the next turn's request sends it."""
        self.n_prompt = len(self.context)
        self._mask: list[np.ndarray] = []
        self._logprobs: list[np.ndarray] = []
        self._versions: list[np.ndarray] = []
        self.turns = self.tool_calls = self.tool_errors = 0
        self.reward: float | None = None
        self.final_text = ""

    def __len__(self) -> int:
        return len(self.context)

    def add_turn(self, turn: Turn) -> None:
        n = len(turn.token_ids)
        self.context = np.concatenate((self.context, np.asarray(turn.token_ids, np.int64)))
        self._mask.append(np.ones(n, np.uint8))
        self._logprobs.append(np.asarray(turn.logprobs, np.float32))
        self._versions.append(np.asarray(turn.versions, np.int64))
        self.turns += 1

    def add_observation(self, ids: list[int]) -> None:
        n = len(ids)
        self.context = np.concatenate((self.context, np.asarray(ids, np.int64)))
        self._mask.append(np.zeros(n, np.uint8))
        self._logprobs.append(np.zeros(n, np.float32))
        self._versions.append(np.full(n, OBSERVATION_VERSION, np.int64))

    def record(self, step: Step) -> None:
        self.tool_calls += step.tool_calls
        self.tool_errors += step.tool_errors
        if step.reward is not None:
            self.reward = float(step.reward)

    def finish(self, reason: str) -> AgentTrajectory:
        def joined(parts: list[np.ndarray], dtype) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype)

        return AgentTrajectory(
            prompt_ids=self.context[:self.n_prompt], response_ids=self.context[self.n_prompt:],
            loss_mask=joined(self._mask, np.uint8), logprobs=joined(self._logprobs, np.float32),
            versions=joined(self._versions, np.int64), finish_reason=reason, reward=self.reward,
            turns=self.turns, tool_calls=self.tool_calls, tool_errors=self.tool_errors, final_text=self.final_text)


class EnvLoop(AgentLoop):
    """The Env-driven loop (see the module docstring).

    ``make_env()`` builds one `Env` per episode; ``tokenizer`` renders with its chat template
    when it has one (`ChatRenderer`), else as plain text (`PlainRenderer`); ``renderer``
    overrides that choice.
    """

    def __init__(self, make_env: Callable[[], Env], tokenizer: Any, config: EnvLoopConfig | None = None, *,
                 renderer: ChatRenderer | PlainRenderer | None = None):
        self.make_env = make_env
        self.config = config or EnvLoopConfig()
        if renderer is None:
            renderer = ChatRenderer(tokenizer) if getattr(tokenizer, "chat_template", None) else PlainRenderer(tokenizer)
        self.renderer = renderer
        self.counts = {"episodes": 0, "turns": 0, "tool_calls": 0, "tool_errors": 0, "env_step_s": 0.0}
        """Totals over this loop's episodes (the Rollouter reports them as ``agent/*``):
        ``env_step_s`` is the time spent in `Env.step` (tool calls included)."""

    async def run(self, prompt: Any, llm: LLM) -> AgentTrajectory:
        self.counts["episodes"] += 1
        env = self.make_env()
        try:
            env.episode_id = getattr(llm, "episode_id", None)  # stable across a resume (call keys)
            opening = await env.reset(prompt)
            ep = _Episode(self.renderer.prompt_ids(opening, getattr(env, "tools", ())))
            return await self._converse(env, ep, llm)
        finally:
            await env.close()

    async def _converse(self, env: Env, ep: _Episode, llm: LLM) -> AgentTrajectory:
        cfg = self.config
        while True:
            room = cfg.max_context_tokens - len(ep)
            if room < 1:
                return ep.finish("context")
            budget = min(cfg.max_tokens_per_turn, room)
            turn = await llm.generate(ep.context, max_tokens=budget,
                                      stop=self.renderer.stop_ids)
            ep.add_turn(turn)
            if turn.finish_reason != "stop":
                if turn.finish_reason == "length" and budget < cfg.max_tokens_per_turn:
                    return ep.finish("context")
                return ep.finish(turn.finish_reason)
            turn_ids = turn.token_ids.tolist()
            ep.final_text = self.renderer.turn_text(turn_ids)
            counts = self.counts
            t0 = time.perf_counter()
            step = await env.step(ep.final_text)
            counts["env_step_s"] += time.perf_counter() - t0
            if not isinstance(step, Step):
                raise TypeError(f"{type(env).__name__}.step must return a Step, got {type(step).__name__}")
            counts["turns"] += 1
            counts["tool_calls"] += step.tool_calls
            counts["tool_errors"] += step.tool_errors
            ep.record(step)
            if step.done:
                return ep.finish("stop")
            if ep.turns >= cfg.max_turns:
                return ep.finish("max_turns")
            obs = self.renderer.observation_ids(turn_ids, step.observation)
            if len(ep) + len(obs) >= cfg.max_context_tokens:
                return ep.finish("context")
            ep.add_observation(obs)


class SingleTurnLoop(AgentLoop):
    """Plain generation as an agent loop: one turn on the prompt's ids, no env, every token trained."""

    def __init__(self, max_tokens: int, stop: tuple[int, ...] = ()):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens, self.stop = max_tokens, tuple(stop)

    async def run(self, prompt: Any, llm: LLM) -> AgentTrajectory:
        ids = getattr(prompt, "prompt_ids", prompt)
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1 or len(ids) == 0:
            raise ValueError(f"SingleTurnLoop: the prompt needs 1-d, non-empty prompt_ids, got shape {ids.shape}")
        budget = getattr(prompt, "max_tokens", None) or self.max_tokens
        turn = await llm.generate(ids, max_tokens=budget, stop=self.stop)
        ep = _Episode(ids)
        ep.add_turn(turn)
        return ep.finish(turn.finish_reason)
