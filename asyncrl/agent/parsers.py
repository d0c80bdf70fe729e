"""Tool-call parsers: the model's turn text -> the calls it makes.

One interface (`ToolCallParser`), one default: `HermesParser`, the format of Hermes and Qwen
(2.5, 3) chat templates: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number
per turn. A call that cannot be read is returned as a `ToolCall` with ``error`` set, so the
model is told what was wrong and the conversation goes on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model wrote (or failed to write: ``error`` says why)."""

    name: str | None
    arguments: Any = None
    error: str | None = None


@runtime_checkable
class ToolCallParser(Protocol):
    def parse(self, text: str) -> list[ToolCall]:
        """The calls in ``text`` in order; ``[]`` when the turn calls no tool (a final answer)."""
        ...


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes/Qwen format).

    An opening tag without its closing tag (a turn cut short) reads to the end of the text.
    ``arguments`` may also be a JSON string holding the object, as some models write it.
    """

    def __init__(self, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>"):
        self.open_tag, self.close_tag = open_tag, close_tag
        self._block = re.compile(re.escape(open_tag) + r"(.*?)(?:" + re.escape(close_tag) + r"|\Z)", re.S)

    def parse(self, text: str) -> list[ToolCall]:
        return [self._one(m.group(1).strip()) for m in self._block.finditer(text)]

    def _one(self, body: str) -> ToolCall:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolCall(None, error=f"malformed tool call JSON ({e.msg} at char {e.pos}): {body[:200]!r}")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ToolCall(None, error=f'a tool call must be {{"name": ..., "arguments": {{...}}}}, got {body[:200]!r}')
        args = call.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return ToolCall(call["name"], error=f"arguments of {call['name']!r} are not a JSON object: {args[:200]!r}")
        return ToolCall(call["name"], args)
