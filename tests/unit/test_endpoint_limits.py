"""An agent whose client raises on a call the endpoint refused at the run's per-episode limit
(calls, context) ends its episode, trained on what was answered; any other exception of the
agent's stays the user's error. Real HTTP, the real ``openai`` client (which raises on the 400)."""

from __future__ import annotations

import openai
import pytest

from asyncrl.agent.endpoint import ClientSpec, EndpointLoop
from asyncrl.agent.endpoint.episode import EpisodeLimits
from tests.unit.endpoint_helpers import TOK, TOOLS, ScriptedLLM

CALL = '<tool_call>{"name": "mul", "arguments": {"a": 6, "b": 7}}</tool_call>'


async def calls_until_refused(row, spec: ClientSpec):
    """Calls the tool for as long as the model asks, catching nothing (as most stacks do)."""
    c = openai.AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0)
    msgs = [{"role": "user", "content": row["prompt"]}]
    while True:
        r = await c.chat.completions.create(model=spec.model, messages=msgs, tools=TOOLS)
        msg = r.choices[0].message
        if not msg.tool_calls:
            return 1.0
        msgs.append(msg.model_dump(exclude_none=True))
        msgs.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "42" * row.get("long", 1)})


async def raises_its_own(row, spec: ClientSpec):
    c = openai.AsyncOpenAI(base_url=spec.base_url, api_key=spec.api_key, max_retries=0)
    await c.chat.completions.create(model=spec.model, messages=[{"role": "user", "content": row["prompt"]}])
    raise KeyError("the agent's own bug")


@pytest.mark.parametrize("limit", ["max_calls", "max_context_tokens"])
async def test_a_call_refused_at_a_limit_ends_the_episode_not_the_run(limit):
    limits = EpisodeLimits(max_calls=2) if limit == "max_calls" else EpisodeLimits(max_context_tokens=360)
    loop = EndpointLoop(TOK, function=calls_until_refused, limits=limits)
    try:
        # the model keeps calling its tool; the 3rd call (or a context grown by long tool output) is refused
        traj = await loop.run({"prompt": "6*7", "long": 1 if limit == "max_calls" else 30},
                              ScriptedLLM([CALL, CALL, CALL, CALL]))
    finally:
        await loop.aclose()
    assert loop.counts["http_limit_ended"] == 1 and loop.counts["http_failed_episodes"] == 0
    assert traj.reward is None  # scored as an agent that returned None: the task's reward function
    # max_calls: two answered, the third refused before it counts; context: the first answered (a
    # 286-token prompt with the tool schema), the second counted and refused at 360 tokens
    assert traj.turns == (2 if limit == "max_calls" else 1) and loop.counts["http_calls"] == 2


async def test_an_agents_own_exception_is_still_its_error():
    loop = EndpointLoop(TOK, function=raises_its_own)
    try:
        with pytest.raises(KeyError, match="own bug"):
            await loop.run({"prompt": "hi"}, ScriptedLLM(["Hello."]))
    finally:
        await loop.aclose()
    assert loop.counts["http_limit_ended"] == 0
