"""The calculator agent as a command: any program that reads ``OPENAI_BASE_URL``,
``OPENAI_API_KEY`` and ``OPENAI_MODEL`` can be trained this way, in any language. This one is
Python's standard library only (``urllib``, no SDK), so a process per episode starts in tens of
milliseconds.

asyncrl starts it once per episode with the prompt row on stdin (JSON) and reads the episode's
reward from the last line it prints:

    python -m asyncrl.launch --task calculator "rollout.agent.command=python examples/command_agent/agent.py"

By hand, against any OpenAI-compatible server:

    echo '{"prompt": "37*48=", "answer": "1776"}' | OPENAI_BASE_URL=http://... OPENAI_API_KEY=k \
        OPENAI_MODEL=m python examples/command_agent/agent.py

The calculator's latency follows ``CALCULATOR_LATENCY_MEDIAN_S`` / ``CALCULATOR_LATENCY_P99_S``
as in `examples.calculator_tool` (log-normal; none by default).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import os
import random
import sys
import time
import urllib.request

MAX_CALLS = 3
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression of integers.",
    "parameters": {"type": "object", "required": ["expression"], "properties": {
        "expression": {"type": "string", "description": "integers with + - * and parentheses, e.g. 37*48"}}}}}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](evaluate(node.left), evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -evaluate(node.operand)
    raise ValueError("only integers, + - * and parentheses are allowed")


def calculator(arguments: str) -> str:
    median, p99 = float(os.environ.get("CALCULATOR_LATENCY_MEDIAN_S", "0")), os.environ.get("CALCULATOR_LATENCY_P99_S")
    if median > 0:  # log-normal: median, and sigma from the 99th percentile (z = 2.326)
        time.sleep(median * math.exp(random.gauss(0, math.log(float(p99) / median) / 2.3263)) if p99 else median)
    try:
        expression = json.loads(arguments)["expression"]
        if len(expression) > 64:
            raise ValueError("expression longer than 64 characters")
        return str(evaluate(ast.parse(expression.strip(), mode="eval").body))
    except (ValueError, SyntaxError, KeyError, TypeError) as e:
        return f"error: {e}"


def chat(messages: list[dict]) -> dict:
    """One ``POST /chat/completions``; the assistant message."""
    body = {"model": os.environ["OPENAI_MODEL"], "messages": messages, "tools": TOOLS, "max_tokens": 64}
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)["choices"][0]["message"]


def answer(row: dict) -> str:
    """The conversation's final assistant text ("" when the model was still calling the tool)."""
    prompt = row["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    for _ in range(MAX_CALLS):
        message = chat(messages)
        messages.append(message)  # echoed back as received
        if not message.get("tool_calls"):
            return message.get("content") or ""
        for call in message["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": calculator(call["function"]["arguments"])})
    return ""


def main() -> None:
    row = json.loads(sys.stdin.read())
    text = answer(row)
    truth = str(row.get("answer") or row["reward_model"]["ground_truth"])
    print(f"answer {text!r}, expected {truth}", file=sys.stderr)
    print(1.0 if text.strip() == truth else 0.0)  # the reward: the last line of stdout


if __name__ == "__main__":
    main()
