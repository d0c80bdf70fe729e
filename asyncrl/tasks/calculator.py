"""The built-in tool-use task: two-digit multiplication with a calculator, ``"37*48="`` -> ``"1776"``.

The tiny models cannot multiply; a `CalculatorEnv` gives them a ``calculator`` tool
(``{"name":"calculator","arguments":{"expression":"37*48"}}`` in the Hermes/Qwen format). A
conversation is: the question, the model's turn (a tool call, or a guess), the tool's result,
the model's final answer. The reward is the task's rule on the last model turn: 1.0 when its
text (stripped) is exactly the product, else 0.0. So a policy earns its reward by calling the
tool and copying the result, which is what RL has to find: the shipped warm-started model
(`asyncrl.demos.calculator`) calls the tool on only part of its samples.

The tool's latency is a setting (`ToolLatency`: none, fixed, or log-normal from a median and a
p99, seeded per call), so the same task serves as the agentic benchmark where tool time is the
tail. Rows follow verl's layout like `asyncrl.tasks.arithmetic`'s.

Left out: other operations in the dataset (the tool itself takes ``+ - *`` of integers).
"""

from __future__ import annotations

import ast
import asyncio
import math
import operator
import random
import re
from dataclasses import dataclass

import numpy as np

from asyncrl.agent import ToolEnv, tool

DATA_SOURCE = "asyncrl/calculator"
SYSTEM = None
"""The task's conversations have no system message (the template's tools line says enough)."""
_PROMPT = re.compile(r"^\s*(\d+)\s*\*\s*(\d+)\s*=?\s*$")
_Z99 = 2.3263478740408408  # the standard normal's 99th percentile


@dataclass(kw_only=True)
class CalculatorTaskConfig:
    """Settings of the multiplication task."""

    min_operand: int = 10
    max_operand: int = 99
    """Operands are drawn uniformly from ``[min_operand, max_operand]``."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(f"min_operand must be in [0, max_operand={self.max_operand}], got {self.min_operand}")


def make_problem(rng: np.random.Generator, config: CalculatorTaskConfig) -> tuple[str, str]:
    """One ``(prompt_text, answer_text)`` pair."""
    a, b = (int(x) for x in rng.integers(config.min_operand, config.max_operand + 1, size=2))
    return f"{a}*{b}=", str(a * b)


def generate_dataset(n: int, seed: int = 0, config: CalculatorTaskConfig | None = None) -> list[dict]:
    """``n`` seeded rows: ``{"prompt", "answer", "data_source", "reward_model": {"ground_truth"}}``."""
    config = config or CalculatorTaskConfig()
    rng = np.random.default_rng([seed, 36])
    rows = []
    for _ in range(n):
        prompt, answer = make_problem(rng, config)
        rows.append({"prompt": prompt, "answer": answer, "data_source": DATA_SOURCE,
                     "reward_model": {"style": "rule", "ground_truth": answer}})
    return rows


def solve(prompt_text: str) -> str:
    """The product of an ``a*b=`` prompt; ValueError names a prompt of another form."""
    m = _PROMPT.match(prompt_text)
    if m is None:
        raise ValueError(f"calculator prompt must look like 'a*b=', got {prompt_text!r}")
    return str(int(m.group(1)) * int(m.group(2)))


def reward(prompt_text: str, response_text: str) -> float:
    """1.0 when the final answer (the last model turn's text, stripped) is exactly the product."""
    return 1.0 if response_text.strip() == solve(prompt_text) else 0.0


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """``expression`` of integers and ``+ - *`` (parentheses allowed), evaluated; ValueError otherwise."""
    if len(expression) > 64:
        raise ValueError(f"expression longer than 64 characters ({len(expression)})")
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"only integers, + - * and parentheses are allowed: {expression!r}")

    return value(tree)


@dataclass(kw_only=True)
class ToolLatency:
    """How long one calculator call takes (wall time, awaited: the event loop stays free)."""

    median_s: float = 0.0
    """0: no wait; else the median latency."""
    p99_s: float | None = None
    """None: every call takes ``median_s``; else a log-normal with this 99th percentile."""
    seed: int = 0
    """Seeds the draws (with each call's expression and how often it was seen in the process)."""

    def __post_init__(self) -> None:
        if self.median_s < 0:
            raise ValueError(f"median_s must be >= 0, got {self.median_s}")
        if self.p99_s is not None and not (self.median_s > 0 and self.p99_s >= self.median_s):
            raise ValueError(f"p99_s={self.p99_s} needs median_s > 0 and p99_s >= median_s={self.median_s}")

    def draw(self, rng: random.Random) -> float:
        if self.median_s == 0:
            return 0.0
        if self.p99_s is None:
            return self.median_s
        sigma = math.log(self.p99_s / self.median_s) / _Z99
        return self.median_s * math.exp(rng.gauss(0.0, sigma))


class CalculatorEnv(ToolEnv):
    """The task's env: a ``calculator`` tool with `ToolLatency`; the task's `reward` scores the answer.

    Built by the launcher with ``rollout.agent.kwargs`` (``--task calculator`` sets
    ``latency_median_s``, ``latency_p99_s`` and ``seed`` there)."""

    _seen: dict[str, int] = {}

    def __init__(self, latency_median_s: float = 0.0, latency_p99_s: float | None = None, seed: int = 0):
        self.latency = ToolLatency(median_s=latency_median_s, p99_s=latency_p99_s, seed=seed)
        self.tool_seconds = 0.0

        @tool(name="calculator")
        async def calculator(expression: str) -> str:
            """Evaluate an arithmetic expression of integers.

            Args:
                expression: integers with + - * and parentheses, e.g. 37*48
            """
            result = str(evaluate(expression))
            if len(CalculatorEnv._seen) > 100_000:  # bounded: a policy may write any expression
                CalculatorEnv._seen.clear()
            seen = CalculatorEnv._seen[expression] = CalculatorEnv._seen.get(expression, 0) + 1
            wait = self.latency.draw(random.Random(f"{self.latency.seed}|{expression}|{seen}"))
            if wait:
                await asyncio.sleep(wait)
            self.tool_seconds += wait
            return result

        super().__init__([calculator], system=SYSTEM)
