"""The calculator agent on LangGraph: the prebuilt ReAct agent (`create_react_agent`) over
langchain-openai's `ChatOpenAI`, with the calculator as a LangChain tool.

Trained unchanged: only the chat model's base URL, key and model name come from asyncrl (`run`
is called once per episode).

    python -m asyncrl.launch --task calculator rollout.agent.function=examples.langgraph_agent.agent:run

No system prompt, so the conversation is the one the task's built-in env has. It returns None,
so the task's reward function scores the final assistant text.
"""

from __future__ import annotations

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

from examples import calculator_tool

MAX_CALLS = 3


@tool
async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers.

    Args:
        expression: integers with + - * and parentheses, e.g. 37*48
    """
    return await calculator_tool.calculator(expression)


async def run(row: dict, client) -> float | None:
    """One episode: ``client`` carries ``base_url``, ``api_key`` and ``model``."""
    model = ChatOpenAI(base_url=client.base_url, api_key=client.api_key, model=client.model, max_tokens=64,
                       use_responses_api=False)
    agent = create_react_agent(model, [calculator])
    try:
        # Each model call and each tool round is one graph step.
        await agent.ainvoke({"messages": calculator_tool.prompt_messages(row)},
                            config={"recursion_limit": 2 * MAX_CALLS})
    except GraphRecursionError:
        pass  # still calling tools at the limit: the final text (none) earns no reward
    return None
