"""`EngineLLM`: the `LLM` an agent loop talks to, over one `RolloutEngine` in this process; and
the base of asyncrl's `LLM` adapters (`AdapterLLM`, `SessionLLM`).

Each turn is one engine request (``{request_id}/t{k}``) with the given sampling settings; a
seeded sampling gets a different seed per turn, so turns are reproducible without repeating
each other. In a run the Rollouter uses its own adapter instead (`asyncrl.rollouter.agents.RolloutLLM`:
the group's replica, a session per conversation, truncated turns resumed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from asyncrl.agent.base import Turn


class AdapterLLM:
    """The base of asyncrl's `LLM` adapters (`EngineLLM`; the Rollouter's `RolloutLLM` and
    `ValidationLLM`): turns go out as requests ``{base}/t{turn}``, counted in ``turns``, and an
    engine's result comes back as a `Turn`."""

    def __init__(self, base: str):
        self.base = base
        """The request ids' stem."""
        self.turns = 0
        """Turns asked for so far."""

    def _next_turn(self) -> int:
        turn, self.turns = self.turns, self.turns + 1
        return turn

    @staticmethod
    def _turn(result: Any) -> Turn:
        return Turn(result.response_ids, result.logprobs, result.versions, result.finish_reason)


class SessionLLM(AdapterLLM):
    """An adapter whose turns go under a session id per conversation (``base``, then ``base/s{j}``
    for the j-th a multi-output loop opens with `session`), so an engine may keep each one's KV
    between turns; ``sessions`` lists them, for ``end_session`` when the run ends."""

    def __init__(self, base: str):
        super().__init__(base)
        self.episode_id = base
        """What an `EnvLoop` gives its env (`Env.episode_id`): the same after a resume (tools' call keys)."""
        self.session_id = base
        self.sessions = [base]

    def session(self) -> str:
        """Start another conversation (a multi-output loop): later turns go under a new session id."""
        self.session_id = f"{self.base}/s{len(self.sessions)}"
        self.sessions.append(self.session_id)
        return self.session_id


class EngineLLM(AdapterLLM):
    """``await llm.generate(ids, max_tokens=..., stop=...)`` -> `Turn`, on ``engine``."""

    def __init__(self, engine: Any, sampling: Any = None, request_id: str = "agent"):
        from asyncrl.types import SamplingParams

        super().__init__(request_id)
        self.engine = engine
        self.sampling = sampling or SamplingParams()
        self.request_id = request_id
        self.requests = 0
        """Engine requests made (one per turn)."""

    async def generate(self, token_ids, *, max_tokens: int, stop: tuple[int, ...] = ()) -> Turn:
        from asyncrl.types import GenerateRequest

        k = self._next_turn()
        s = self.sampling
        stop_ids = tuple(dict.fromkeys((*s.stop_token_ids, *stop)))
        sampling = dataclasses.replace(s, stop_token_ids=stop_ids, seed=None if s.seed is None else s.seed + k)
        request = GenerateRequest(f"{self.request_id}/t{k}", np.asarray(token_ids, dtype=np.int64),
                                  max_tokens=max_tokens, sampling=sampling)
        self.requests += 1
        return self._turn(await self.engine.generate(request))
