"""Anthropic's Messages API on the episode endpoint: ``POST /s/{episode}/v1/messages``.

What Claude-Code-style agents call (their base URL is ``{server}/s/{episode}``, without ``/v1``;
the key goes in ``x-api-key`` or as a Bearer token). A request is translated into a
``chat/completions`` body and answered by `Episode.answer`, so its history is matched, forked,
limited and recorded exactly as a chat call's (docs/endpoint.md):

- ``system`` (a text or text blocks, joined by a newline) is the system message; ``messages``
  hold ``text``, ``tool_use`` (an assistant tool call) and ``tool_result`` (a tool message, in
  block order) blocks; ``cache_control`` marks are ignored. An answer echoed back maps to the ids
  the engine sampled (its ``toolu_`` ids may change: ids are not compared).
- ``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice`` ``auto`` / ``none``,
  ``max_tokens`` (required), ``stop_sequences``, ``stream`` (the answer as Messages events once
  it is sampled: the engine returns a turn whole). ``POST /v1/messages/count_tokens`` renders a
  request's prompt and counts it.
- Refused with 400 naming the field: a missing ``max_tokens``, images and documents, server tools
  (a tool with a ``type`` other than ``custom``), ``mcp_servers``, ``container``, a forced
  ``tool_choice`` (``any``, ``tool``). The run's sampling applies: ``temperature``, ``top_p``,
  ``top_k`` and ``thinking`` are ignored.

Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}``; the message names the field.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import Request  # (module level: the routes' annotations are resolved by name)
from fastapi.responses import JSONResponse, StreamingResponse

from asyncrl.agent.endpoint.api_common import arguments_object, chat_tool, positive_int, read_json, refuse, sse, text_of
from asyncrl.agent.endpoint.episode import Answer, EndpointError
from asyncrl.agent.endpoint.history import template_message

_REFUSED = {"mcp_servers": "run MCP tools in the agent", "container": "run code tools in the agent"}
_STOP = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}
_ERROR = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          409: "invalid_request_error", 429: "rate_limit_error"}
_NO_RETRY = {"x-should-retry": "false"}


def to_chat(body: Any, *, generate: bool = True) -> dict:
    """The ``chat/completions`` body a Messages request stands for (400 naming a refused field)."""
    if not isinstance(body, dict):
        raise EndpointError(400, "the request body must be a JSON object")
    refuse(body, _REFUSED)
    chat: dict = {"messages": _messages(body)}
    if generate:
        chat["max_tokens"] = positive_int(body, "max_tokens", required=True)
    choice = body.get("tool_choice") or {"type": "auto"}
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "none"):
        raise EndpointError(400, f"tool_choice={json.dumps(choice)}: only auto or none (forcing a call would change "
                            "what the policy samples)", param="tool_choice")
    chat["tool_choice"] = choice["type"]
    tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(body.get("tools") or ())]
    if tools:
        chat["tools"] = tools
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)):
        raise EndpointError(400, "stop_sequences must be a list of non-empty texts", param="stop_sequences")
    chat["stop"] = stops
    return chat


def _tool(t: Any, where: str) -> dict:
    if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
        kind = t.get("type") if isinstance(t, dict) else t
        raise EndpointError(400, f"{where}.type={kind!r}: only custom tools (name, description, input_schema); run "
                            "server tools in the agent", param=f"{where}.type")
    return chat_tool(t.get("name"), t.get("description"), t.get("input_schema"), where)


def _messages(body: dict) -> list[dict]:
    """``system`` + ``messages`` as chat messages (the module docstring)."""
    out: list[dict] = []
    system = body.get("system")
    if isinstance(system, list):
        system = "\n".join(text_of([b], ("text",), f"system[{j}]") for j, b in enumerate(system))
    elif system is not None and not isinstance(system, str):
        raise EndpointError(400, "system must be a text or a list of text blocks", param="system")
    if system:
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EndpointError(400, "messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise EndpointError(400, f"messages[{i}].role must be user or assistant, got {role!r}",
                                param=f"messages[{i}].role")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise EndpointError(400, f"messages[{i}].content must be a text or a list of blocks",
                                param=f"messages[{i}].content")
        out += _assistant(blocks, i) if role == "assistant" else _user(blocks, i)
    return out


def _assistant(blocks: list, i: int) -> list[dict]:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(b.get("text") or "")
        elif kind == "tool_use":
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name"), "arguments": b.get("input") or {}}})
        else:
            raise EndpointError(400, f"messages[{i}].content[{j}].type={kind!r}: an assistant message holds text and "
                                "tool_use blocks", param=f"messages[{i}].content[{j}].type")
    m: dict = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        m["tool_calls"] = calls
    return [m]


def _user(blocks: list, i: int) -> list[dict]:
    """Text blocks as user messages, each ``tool_result`` as a tool message, in block order."""
    out: list[dict] = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        where = f"messages[{i}].content[{j}]"
        if kind == "text":
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += b.get("text") or ""
            else:
                out.append({"role": "user", "content": b.get("text") or ""})
        elif kind == "tool_result":
            result = b.get("content")
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                        "content": text_of(result if result is not None else "", ("text",), f"{where}.content")})
        else:
            raise EndpointError(400, f"{where}.type={kind!r}: a user message holds text and tool_result blocks (a text "
                                "model)", param=f"{where}.type")
    return out


def message_body(a: Answer, model: str) -> dict:
    """The ``message`` object of an answer (Anthropic's schema)."""
    msg = a.message
    content: list[dict] = []
    if msg.get("content") or not msg.get("tool_calls"):
        content.append({"type": "text", "text": msg.get("content") or ""})
    for c in msg.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"),
                        "name": c["function"]["name"], "input": arguments_object(c["function"]["arguments"])})
    reason = "stop_sequence" if a.stop is not None and a.finish == "stop" else _STOP[a.finish]
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": a.stop if reason == "stop_sequence" else None,
            "usage": {"input_tokens": a.prompt_tokens, "output_tokens": a.completion_tokens}}


def stream_events(message: dict) -> list[dict]:
    """A finished message as the Messages API streams one."""
    usage = message["usage"]
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 0}}
    events: list[dict] = [{"type": "message_start", "message": start}]
    for k, block in enumerate(message["content"]):
        if block["type"] == "text":
            first, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            first = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [{"type": "content_block_start", "index": k, "content_block": first},
                   {"type": "content_block_delta", "index": k, "delta": delta},
                   {"type": "content_block_stop", "index": k}]
    events += [{"type": "message_delta", "delta": {"stop_reason": message["stop_reason"],
                                                   "stop_sequence": message["stop_sequence"]},
                "usage": {"output_tokens": usage["output_tokens"]}},
               {"type": "message_stop"}]
    return events


def _error(server: Any, e: EndpointError) -> JSONResponse:
    server.errors += 1
    body = {"type": "error", "error": {"type": _ERROR.get(e.status, "api_error"), "message": str(e)}}
    return JSONResponse(body, status_code=e.status, headers=_NO_RETRY)


def add_routes(app: Any, server: Any, serve_call: Any) -> None:
    """Register ``POST /s/{episode}/v1/messages`` (and ``/count_tokens``) on ``app``."""

    def lookup(episode: str, request: Any) -> Any:
        key = request.headers.get("x-api-key")
        return server.lookup(episode, key if key is not None else request.headers.get("authorization"))

    @app.post("/s/{episode}/v1/messages")
    async def messages(episode: str, request: Request):
        try:
            ep = lookup(episode, request)
            body = await read_json(request)
            chat = to_chat(body)
            server.calls += 1
            out = message_body(await serve_call(server, ep, request, ep.answer(chat)), ep.model)
        except EndpointError as e:
            return _error(server, e)
        if not body.get("stream"):
            return JSONResponse(out)
        return StreamingResponse(sse(stream_events(out)), media_type="text/event-stream")

    @app.post("/s/{episode}/v1/messages/count_tokens")
    async def count_tokens(episode: str, request: Request):
        try:
            ep = lookup(episode, request)
            chat = to_chat(await read_json(request), generate=False)
        except EndpointError as e:
            return _error(server, e)
        ids = ep.renderer.prompt_ids([template_message(m, None) for m in chat["messages"]], chat.get("tools") or ())
        return {"input_tokens": len(ids)}
