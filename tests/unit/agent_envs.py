"""Envs and loops the agent tests name by path (``rollout.agent.env=tests.unit.agent_envs:LookupEnv``)."""

from __future__ import annotations

import asyncio

from asyncrl.agent import AgentLoop, Env, ToolEnv, tool


@tool
def lookup(key: str) -> str:
    """Look up a key.

    Args:
        key: the key
    """
    return key.upper()


class LookupEnv(ToolEnv):
    """One @tool; the task's reward function scores the final answer."""

    def __init__(self):
        super().__init__([lookup])


class GatedLookupEnv(ToolEnv):
    """``lookup`` as an async tool that waits for the test's go (a weight sync lands meanwhile)."""

    called: asyncio.Event | None = None
    go: asyncio.Event | None = None

    def __init__(self):
        async def gated_lookup(key: str) -> str:
            """Look up a key.

            Args:
                key: the key
            """
            type(self).called.set()
            await type(self).go.wait()
            return key.upper()

        super().__init__([tool(gated_lookup, name="lookup")])


class ExplodingEnv(Env):
    async def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}]

    async def step(self, text):
        raise RuntimeError("env exploded")


class TwoSessions(AgentLoop):
    """A multi-output loop: two one-turn conversations per prompt; drops the second when the
    prompt says so."""

    async def run(self, prompt, llm):
        from asyncrl.agent.loop import SingleTurnLoop

        first = await SingleTurnLoop(max_tokens=4).run(prompt, llm)
        if "drop" in prompt.text:
            return [first]
        llm.session()
        return [first, await SingleTurnLoop(max_tokens=4).run(prompt, llm)]


class NoStep:
    async def reset(self, prompt):
        return prompt.text
