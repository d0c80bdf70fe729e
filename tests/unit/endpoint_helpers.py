"""Helpers of the endpoint tests: a scripted `LLM` over the tiny ChatML tokenizer, and an episode
served on a real `EndpointServer` (real HTTP on loopback, the real ``openai`` client)."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from asyncrl.agent.base import Turn
from asyncrl.agent.endpoint.episode import Episode, EpisodeLimits
from asyncrl.agent.endpoint.server import EndpointServer
from asyncrl.agent.render import ChatRenderer
from asyncrl.models.tiny_chat import build_chat_tokenizer

TOK = build_chat_tokenizer()
RENDERER = ChatRenderer(TOK)
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
TOOLS = [{"type": "function", "function": {"name": "mul", "description": "multiply",
                                             "parameters": {"type": "object", "properties": {
                                                 "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


class ScriptedLLM:
    """Answers each call with the next scripted text (+ ``<|im_end|>``): log-probs and versions
    distinct per call, every prompt kept. ``gate``: when set, a call waits on it (to hold calls
    in flight); ``cancelled`` counts calls cancelled while generating (an aborted request)."""

    def __init__(self, texts=(), *, gate: asyncio.Event | None = None):
        self.texts = list(texts)
        self.prompts: list[list[int]] = []
        self.turns: list[list[int]] = []
        self.gate = gate
        self.cancelled = 0
        self.started = asyncio.Event()
        self.episode_id = "sample_0_0/0"

    async def generate(self, token_ids, *, max_tokens: int, stop=()) -> Turn:
        assert IM_END in stop
        self.prompts.append(np.asarray(token_ids).tolist())
        k = len(self.prompts)
        text = self.texts.pop(0) if self.texts else f"answer {k}"
        self.started.set()
        if self.gate is not None:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        ids = TOK.encode(text, add_special_tokens=False)[:max_tokens]
        finish = "length" if len(ids) == max_tokens else "stop"
        if finish == "stop":
            ids = ids + [IM_END]
        self.turns.append(ids)
        n = len(ids)
        return Turn(ids, np.full(n, -0.01 * k, np.float32), np.full(n, k, np.int64), finish)


@contextlib.asynccontextmanager
async def serving(llm, limits: EpisodeLimits | None = None):
    """An `Episode` on ``llm`` served on a started `EndpointServer`; yields (server, episode)."""
    server = EndpointServer("127.0.0.1", 0)
    await server.start()
    ep = Episode("ep-test", llm, RENDERER, limits or EpisodeLimits(), "policy")
    server.add(ep)
    try:
        yield server, ep
    finally:
        await server.close()


def client(server: EndpointServer, ep: Episode, *, sync: bool = False, key: str | None = None):
    import openai

    cls = openai.OpenAI if sync else openai.AsyncOpenAI
    return cls(base_url=server.base_url(ep), api_key=key or ep.secret, max_retries=0)
