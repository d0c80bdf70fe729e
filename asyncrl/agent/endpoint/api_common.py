"""What the Responses and Messages routes share: reading a body, SSE framing, tool translation.

Both routes translate their request into a ``chat/completions`` body and answer from
`Episode.answer`, so history matching, forks, limits and recording are the chat route's own.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

from asyncrl.agent.endpoint.episode import EndpointError


async def read_json(request: Any) -> Any:
    """The request's JSON body (400 when it is not JSON)."""
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise EndpointError(400, "the request body is not JSON") from None


async def sse(events: Iterable[dict]) -> AsyncIterator[str]:
    """Named server-sent events (``event: <type>``), as both APIs stream them."""
    for e in events:
        yield f"event: {e['type']}\ndata: {json.dumps(e)}\n\n"


def refuse(body: dict, refused: dict[str, str]) -> None:
    """400 naming the first field of ``refused`` that ``body`` sets (None, False, [] and {} are unset)."""
    for name, why in refused.items():
        if body.get(name) not in (None, False, [], {}):
            raise EndpointError(400, f"{name} is not supported here: {why}", param=name)


def chat_tool(name: Any, description: Any, parameters: Any, where: str) -> dict:
    """A function tool in the chat schema (what the renderer and the history's tools key take)."""
    if not isinstance(name, str) or not name:
        raise EndpointError(400, f"{where}.name must be a non-empty text", param=f"{where}.name")
    fn: dict = {"name": name}
    if description:
        fn["description"] = description
    fn["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def text_of(parts: Any, kinds: tuple[str, ...], where: str) -> str:
    """The text of a content given as a text or a list of text parts of the ``kinds`` types; any
    other part (an image, a file) is refused naming it."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise EndpointError(400, f"{where} must be a text or a list of content parts", param=where)
    out = []
    for j, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in kinds:
            raise EndpointError(400, f"{where}[{j}].type={kind!r}: only {', '.join(kinds)} parts (a text model)",
                                param=f"{where}[{j}].type")
        out.append(p.get("text") if kind != "refusal" else p.get("refusal") or "")
    return "".join(t or "" for t in out)


def positive_int(body: dict, name: str, *, required: bool = False) -> int | None:
    """``body[name]`` as a positive integer (400 naming it otherwise)."""
    value = body.get(name)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EndpointError(400, f"{name} must be a positive integer, got {value!r}", param=name)
    return value


def arguments_object(arguments: str) -> dict:
    """A tool call's JSON-text arguments as an object (a non-object is kept under ``"input"``)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"input": arguments}
    return value if isinstance(value, dict) else {"input": value}
