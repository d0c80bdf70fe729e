"""One episode behind the endpoint: its secret, its limits, its history, and each call's generation.

HTTP-free: `Episode.chat` / `Episode.complete` take a request body (a dict in OpenAI's schema)
and return the response body, or raise `EndpointError` (an HTTP status and a message naming
the field). `asyncrl.agent.endpoint.server` maps them to routes. `Episode.answer` is the chat call
before OpenAI's schema: the Responses and Messages routes write it in theirs.

Sampling rule: every token is sampled with the run's settings (``rollout.temperature``,
``top_p``, ``top_k``, through the `LLM` the episode got), so the behaviour log-probs are the
policy's and the trainer's importance ratio stays exact. A request's own ``temperature``,
``top_p``, ``seed``, ``presence_penalty`` and the like are accepted and ignored; what cannot be
honoured without changing what is sampled (``n`` > 1, ``logprobs``, ``response_format``, a forced
``tool_choice``) is refused with 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.agent.base import LLM, Turn
from asyncrl.agent.endpoint.history import History, Placement, Sampled
from asyncrl.agent.parsers import HermesParser


class EndpointError(Exception):
    """An HTTP error answer: ``status``, a message naming the field and the fix, OpenAI's ``type`` / ``param`` / ``code``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                409: "conflict_error", 429: "rate_limit_error"}.get(self.status, "server_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(kw_only=True)
class EpisodeLimits:
    """What one episode may use (from ``rollout.agent``: `asyncrl.agent.endpoint.config.limits_of`)."""

    max_calls: int = 64
    """Calls per episode; the next one is refused (400, code ``episode_calls_exceeded``)."""
    max_context_tokens: int = 4096
    """Prompt + response tokens of one call's branch; a call with no room left is refused (400,
    ``context_length_exceeded``); its ``max_tokens`` is cut to the room left."""
    max_tokens_per_call: int = 512
    """A call's ``max_tokens`` when it gives none (and the most it may ask)."""
    max_episode_s: float = 600.0
    """Wall time of an episode; past it the agent is stopped and later calls get 409."""

    def __post_init__(self) -> None:
        for name in ("max_calls", "max_context_tokens", "max_tokens_per_call"):
            if getattr(self, name) < 1:
                raise ValueError(f"EpisodeLimits.{name} must be >= 1, got {getattr(self, name)}")
        if not self.max_episode_s > 0:
            raise ValueError(f"EpisodeLimits.max_episode_s must be > 0, got {self.max_episode_s}")


_REFUSED = {"logprobs": "behaviour log-probs are the trainer's, not returned",
            "top_logprobs": "behaviour log-probs are the trainer's, not returned",
            "response_format": "structured output would change what the policy samples",
            "prediction": "predicted outputs would change what the policy samples",
            "audio": "not a text model", "modalities": "not a text model"}


def check_request(body: dict, *, chat: bool) -> None:
    """400 naming the field for what the endpoint cannot honour exactly (the module docstring)."""
    if not isinstance(body, dict):
        raise EndpointError(400, "the request body must be a JSON object")
    if body.get("n") not in (None, 1):
        raise EndpointError(400, f"n={body['n']}: one choice per call (make n calls; each is its own turn)", param="n")
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False, [], {"type": "text"}):
            raise EndpointError(400, f"{name} is not supported: {why}", param=name)
    if chat:
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise EndpointError(400, "messages must be a non-empty list of chat messages", param="messages")
        for i, m in enumerate(body["messages"]):
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise EndpointError(400, f"messages[{i}] needs a role of system, user, assistant or tool",
                                    param=f"messages[{i}].role")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise EndpointError(400, f"tool_choice={json.dumps(choice)}: only auto or none (forcing a call would change "
                                "what the policy samples)", param="tool_choice")
    elif not isinstance(body.get("prompt"), (str, list)):
        raise EndpointError(400, "prompt must be a text or a list of token ids", param="prompt")


@dataclass
class Answer:
    """A chat call's result, before it is written in an API's schema."""

    message: dict
    """The assistant message (``content``, ``tool_calls`` with ``call_`` ids and JSON-text arguments)."""
    finish: str
    """``tool_calls``, ``stop`` or ``length``."""
    stop: str | None
    """The request's stop text that ended the turn (None: none did)."""
    placement: Placement
    turn: Turn

    @property
    def prompt_tokens(self) -> int:
        return len(self.placement.context)

    @property
    def completion_tokens(self) -> int:
        return len(self.turn.token_ids)


class Episode:
    """One episode's endpoint state: serve its calls on ``llm``, record them in its `History`."""

    def __init__(self, episode_id: str, llm: LLM, renderer: Any, limits: EpisodeLimits, model: str):
        self.id, self.llm, self.renderer, self.limits, self.model = episode_id, llm, renderer, limits, model
        self.secret = "sk-ep-" + secrets.token_hex(16)
        self.history = History(renderer)
        self.parser = HermesParser()
        self.deadline = time.monotonic() + limits.max_episode_s
        self.calls = 0
        self.tool_calls = 0
        """Tool calls parsed into the answers (``tool_calls`` of each assistant turn)."""
        self.tool_call_turns = 0
        """Answers that carried at least one tool call."""
        self.reward: float | None = None
        """A reward posted to ``/s/{episode}/reward`` (None: none yet)."""
        self.ended: str | None = None
        """Why the episode ended (None: it is open)."""
        self.limit_hit: str | None = None
        """The first of the run's per-episode limits a call was refused for (its calls, its context):
        an exception the agent raises after that ends the episode, not the run (`EndpointLoop.run`)."""
        self.in_flight: set[asyncio.Task] = set()
        """Calls generating now (cancelled when the episode ends)."""

    def admit(self) -> None:
        """Count a call, or refuse it: 409 after the end, 400 past a limit."""
        if self.ended is not None:
            raise EndpointError(409, f"episode {self.id} has ended ({self.ended}); its calls are closed", code="episode_ended")
        if time.monotonic() > self.deadline:
            raise EndpointError(409, f"episode {self.id} ran past its wall time (rollout.agent.endpoint_max_episode_s="
                                f"{self.limits.max_episode_s})", code="episode_wall_time")
        if self.calls >= self.limits.max_calls:
            self.limit_hit = self.limit_hit or "rollout.agent.max_turns"
            raise EndpointError(400, f"episode {self.id} made its {self.limits.max_calls} calls "
                                "(rollout.agent.max_turns)", code="episode_calls_exceeded")
        self.calls += 1

    def _budget(self, body: dict, context_len: int) -> int:
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if asked is not None and (not isinstance(asked, int) or asked < 1):
            raise EndpointError(400, f"max_tokens must be a positive integer, got {asked!r}", param="max_tokens")
        room = self.limits.max_context_tokens - context_len
        if room < 1:
            self.limit_hit = self.limit_hit or "rollout.agent.max_context_tokens"
            raise EndpointError(400, f"the conversation holds {context_len} tokens, the episode's context is "
                                f"{self.limits.max_context_tokens} (rollout.agent.max_context_tokens)",
                                param="messages", code="context_length_exceeded")
        return min(asked or self.limits.max_tokens_per_call, self.limits.max_tokens_per_call, room)

    def _stops(self, body: dict) -> list[str]:
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            raise EndpointError(400, "stop must be a non-empty text or a list of them", param="stop")
        return stops

    async def _generate(self, context: np.ndarray, budget: int, stops: list[str]) -> tuple[Turn, str, str | None]:
        """The turn (cut after a stop text), its text (cut before it) and the stop text that ended it (or None)."""
        turn = await self.llm.generate(context, max_tokens=budget, stop=tuple(self.renderer.stop_ids))
        ids = turn.token_ids.tolist()
        text = self.renderer.turn_text(ids)
        hits = [(text.find(s), len(s), s) for s in stops if s in text]
        if not hits:
            return turn, text, None
        cut_at, n, hit = min(hits)
        lo, hi = 1, len(ids)  # the fewest tokens whose text holds the whole stop text: kept, the rest dropped
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.renderer.turn_text(ids[:mid])) >= cut_at + n:
                hi = mid
            else:
                lo = mid + 1
        kept = Turn(turn.token_ids[:lo], turn.logprobs[:lo], turn.versions[:lo], "stop")
        return kept, text[:cut_at], hit

    def _message(self, text: str, tools_on: bool) -> tuple[dict, str]:
        """The assistant message for a turn's text, and whether it calls tools."""
        calls = [c for c in self.parser.parse(text) if c.error is None] if tools_on else []
        if not calls:
            return {"role": "assistant", "content": text}, ""
        head = text.split(self.parser.open_tag, 1)[0].strip()
        tool_calls = [{"id": f"call_{os.urandom(12).hex()}", "type": "function",
                       "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]
        return {"role": "assistant", "content": head or None, "tool_calls": tool_calls}, "tool_calls"

    async def chat(self, body: dict) -> dict:
        """``POST /chat/completions``: the response body (OpenAI's ``chat.completion``)."""
        a = await self.answer(body)
        return self._body("chat.completion", {"index": 0, "message": a.message, "finish_reason": a.finish,
                                              "logprobs": None}, a.placement, a.turn)

    async def answer(self, body: dict) -> Answer:
        """One chat call (a ``chat/completions`` body), sampled and recorded: what every chat-shaped
        route (chat completions, the Responses and Messages APIs) answers from."""
        check_request(body, chat=True)
        self.admit()
        stops = self._stops(body)
        tools = body.get("tools") or None
        placement = self.history.place(body["messages"], tools)
        try:
            budget = self._budget(body, len(placement.context))
            turn, text, stopped = await self._generate(placement.context, budget, stops)
        except BaseException:
            self.history.release(placement)
            raise
        message, calls_finish = self._message(text, tools is not None and body.get("tool_choice") != "none")
        self.history.commit(placement, turn, Sampled(text, message))
        self.tool_calls += len(message.get("tool_calls") or ())
        self.tool_call_turns += bool(message.get("tool_calls"))
        finish = calls_finish or ("length" if turn.finish_reason == "length" and not stopped else "stop")
        return Answer(message, finish, stopped, placement, turn)

    async def complete(self, body: dict) -> dict:
        """``POST /completions`` (a text or token-id prompt): continued as is, recorded as its own branch."""
        check_request(body, chat=False)
        self.admit()
        prompt = body["prompt"]
        if isinstance(prompt, list) and not all(isinstance(i, int) for i in prompt):
            raise EndpointError(400, "prompt must be one text or one list of token ids (no batches)", param="prompt")
        ids = np.asarray(self.renderer.encode(prompt) if isinstance(prompt, str) else prompt, np.int64)
        from asyncrl.agent.endpoint.history import Branch

        placement = Placement(Branch("completions", ids, busy=True), True, ids, [], [("completions", str(prompt), None)])
        try:
            turn, text, stopped = await self._generate(ids, self._budget(body, len(ids)), self._stops(body))
        except BaseException:
            self.history.release(placement)
            raise
        self.history.commit(placement, turn, Sampled(text, {"role": "assistant", "content": text}))
        finish = "length" if turn.finish_reason == "length" and not stopped else "stop"
        return self._body("text_completion", {"index": 0, "text": text, "finish_reason": finish, "logprobs": None},
                          placement, turn)

    def _body(self, kind: str, choice: dict, placement: Placement, turn: Turn) -> dict:
        n_prompt, n_out = len(placement.context), len(turn.token_ids)
        return {"id": f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{os.urandom(16).hex()}", "object": kind,
                "created": int(time.time()), "model": self.model, "choices": [choice],
                "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}}

    def post_reward(self, body: Any) -> float:
        """``POST /s/{episode}/reward`` with ``{"reward": float}``."""
        value = body.get("reward") if isinstance(body, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
            raise EndpointError(400, f'the body must be {{"reward": <finite number>}}, got {json.dumps(body)[:200]}',
                                param="reward")
        if self.ended is not None:
            raise EndpointError(409, f"episode {self.id} has ended ({self.ended})", code="episode_ended")
        self.reward = float(value)
        return self.reward

    def end(self, why: str) -> None:
        """Close the episode: later calls get 409; calls still generating are cancelled (aborted)."""
        if self.ended is None:
            self.ended = why
        for task in list(self.in_flight):
            task.cancel()
