"""`EngineLLM`: the `LLM` an agent loop talks to, over one `RolloutEngine` in this process.

Each turn is one engine request (``{request_id}/t{k}``) with the given sampling settings; a
seeded sampling gets a different seed per turn, so turns are reproducible without repeating
each other. In a run the Rollouter uses its own adapter instead (`asyncrl.rollouter.agents.RolloutLLM`:
the group's replica, a session per conversation, truncated turns resumed).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np

from asyncrl.agent.base import Turn


class EngineLLM:
    """``await llm.generate(ids, max_tokens=..., stop=...)`` -> `Turn`, on ``engine``."""

    def __init__(self, engine: Any, sampling: Any = None, request_id: str = "agent"):
        from asyncrl.types import SamplingParams

        self.engine = engine
        self.sampling = sampling or SamplingParams()
        self.request_id = request_id
        self._turns = itertools.count()
        self.requests = 0
        """Engine requests made (one per turn)."""

    async def generate(self, token_ids, *, max_tokens: int, stop: tuple[int, ...] = ()) -> Turn:
        from asyncrl.types import GenerateRequest

        k = next(self._turns)
        s = self.sampling
        stop_ids = tuple(dict.fromkeys((*s.stop_token_ids, *stop)))
        sampling = dataclasses.replace(s, stop_token_ids=stop_ids, seed=None if s.seed is None else s.seed + k)
        request = GenerateRequest(f"{self.request_id}/t{k}", np.asarray(token_ids, dtype=np.int64),
                                  max_tokens=max_tokens, sampling=sampling)
        self.requests += 1
        result = await self.engine.generate(request)
        return Turn(result.response_ids, result.logprobs, result.versions, result.finish_reason)
