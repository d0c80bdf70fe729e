"""The calculator every example agent gives its model: the tool of the built-in calculator task
(`asyncrl.tasks.calculator`), run on the agent's side, as a user's own tool would be.

Its latency is read from the environment, so a benchmark can give the client-side tool the long
tail the task's env has (``scripts/bench_agent.py --agent openai``): ``CALCULATOR_LATENCY_MEDIAN_S``
(default 0: no wait) and ``CALCULATOR_LATENCY_P99_S`` (unset: every call takes the median; else a
log-normal with that 99th percentile; ``CALCULATOR_LATENCY_SEED`` seeds the draws). The schema is OpenAI's function-tool JSON; the stacks that
build it from a typed function (the Agents SDK, LangChain) produce the same name and argument.
"""

from __future__ import annotations

import asyncio
import os
import random

from asyncrl.tasks.calculator import ToolLatency, evaluate

NAME = "calculator"
DESCRIPTION = "Evaluate an arithmetic expression of integers."
SCHEMA = {
    "type": "function",
    "function": {
        "name": NAME,
        "description": DESCRIPTION,
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string",
                                          "description": "integers with + - * and parentheses, e.g. 37*48"}},
            "required": ["expression"],
        },
    },
}
_seen: dict[str, int] = {}


def latency() -> ToolLatency:
    """The tool's latency from ``CALCULATOR_LATENCY_MEDIAN_S`` / ``CALCULATOR_LATENCY_P99_S``."""
    p99 = os.environ.get("CALCULATOR_LATENCY_P99_S")
    return ToolLatency(median_s=float(os.environ.get("CALCULATOR_LATENCY_MEDIAN_S", "0")),
                       p99_s=float(p99) if p99 else None)


def compute(expression: str) -> str:
    """The result as the task's env words it, or an error line the model sees instead."""
    try:
        return str(evaluate(expression))
    except ValueError as e:
        return f"error: {e}"


async def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers, after the tool's latency (awaited).

    The latency is drawn as the task's env draws it: seeded by the expression and how often this
    process saw it, so runs of different modes meet the same draws for the same calls."""
    if len(_seen) > 100_000:  # bounded: a policy may write any expression
        _seen.clear()
    seen = _seen[expression] = _seen.get(expression, 0) + 1
    wait = latency().draw(random.Random(f"{os.environ.get('CALCULATOR_LATENCY_SEED', '0')}|{expression}|{seen}"))
    if wait:
        await asyncio.sleep(wait)
    return compute(expression)


def prompt_messages(row: dict) -> list[dict]:
    """The row's prompt as chat messages (the calculator task's prompt is one user text)."""
    prompt = row["prompt"]
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
