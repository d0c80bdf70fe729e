"""The calculator agent on the OpenAI Agents SDK: an `Agent` with a `function_tool`, run by
`Runner.run` on the SDK's chat-completions model over an `AsyncOpenAI` client.

Trained unchanged: only the client's base URL, key and model name come from asyncrl (`run` is
called once per episode). Tracing is off (it would upload traces to OpenAI).

    python -m asyncrl.launch --task calculator rollout.agent.function=examples.agents_sdk_agent.agent:run

The agent has no instructions, so no system message: the conversation is the one the task's
built-in env has. It returns None, so the task's reward function scores the final assistant text.
"""

from __future__ import annotations

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from openai import AsyncOpenAI

from examples import calculator_tool

set_tracing_disabled(True)
MAX_TURNS = 3


@function_tool
async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers.

    Args:
        expression: integers with + - * and parentheses, e.g. 37*48
    """
    return await calculator_tool.calculator(expression)


async def run(row: dict, client) -> float | None:
    """One episode: ``client`` carries ``base_url``, ``api_key`` and ``model``."""
    openai = AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)
    agent = Agent(name="calculator", tools=[calculator], model_settings=ModelSettings(max_tokens=64),
                  model=OpenAIChatCompletionsModel(model=client.model, openai_client=openai))
    async with openai:
        try:
            await Runner.run(agent, calculator_tool.prompt_messages(row), max_turns=MAX_TURNS)
        except MaxTurnsExceeded:
            pass  # still calling tools at the limit: the final text (none) earns no reward
        except ModelBehaviorError:
            # The policy called a tool the agent lacks (a misspelt name) or sent arguments that are
            # not JSON: the SDK gives up on the run. That is the model's mistake, which RL should
            # teach away, not an error in this code: the episode ends without an answer (reward 0).
            pass
    return None
