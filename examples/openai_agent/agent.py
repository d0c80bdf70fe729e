"""A plain agent loop on the ``openai`` client: the model may call a client-side calculator tool
(OpenAI's tools schema), the loop runs it and sends the result back, until the model answers.

Nothing in it knows about asyncrl: it is trained by pointing it at the run's endpoint, which the
launcher does by calling `run` once per episode with the episode's base URL, key and model name.

    python -m asyncrl.launch --task calculator rollout.agent.function=examples.openai_agent.agent:run

It returns None, so the task's reward function scores the final assistant text.
"""

from __future__ import annotations

import json

from openai import AsyncOpenAI

from examples.calculator_tool import SCHEMA, calculator, prompt_messages

MAX_CALLS = 3
"""Model calls per episode (question -> tool call -> answer is two)."""
MAX_TOKENS = 64


async def run_tool(call) -> str:
    try:
        args = json.loads(call.function.arguments)
        return await calculator(**args)
    except (json.JSONDecodeError, TypeError) as e:  # the model wrote arguments the tool does not take
        return f"error: bad arguments {call.function.arguments!r} ({e})"


async def run(row: dict, client) -> float | None:
    """One episode: ``client`` carries ``base_url``, ``api_key`` and ``model``."""
    openai = AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)
    messages = prompt_messages(row)
    async with openai:
        for _ in range(MAX_CALLS):
            response = await openai.chat.completions.create(model=client.model, messages=messages,
                                                            tools=[SCHEMA], max_tokens=MAX_TOKENS)
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))  # the assistant turn, echoed back as is
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": await run_tool(call)})
    return None
