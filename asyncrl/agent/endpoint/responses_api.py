"""OpenAI's Responses API on the episode endpoint: ``POST /s/{episode}/v1/responses``.

What the OpenAI Agents SDK's default model and Codex-style CLIs call. A request is translated
into a ``chat/completions`` body and answered by `Episode.answer`, so its history is matched,
forked, limited and recorded exactly as a chat call's (docs/endpoint.md):

- ``instructions`` is the system message; ``input`` a text (one user message) or a list of items:
  messages (``input_text`` / ``output_text`` parts), ``function_call`` (an assistant tool call: it
  joins the assistant message before it, as the answer's items came) and ``function_call_output``
  (a tool message). An answer's items echoed back map to the ids the engine sampled.
- ``tools`` (function tools, flat: ``{type: function, name, parameters}``), ``tool_choice``
  ``auto`` / ``none``, ``max_output_tokens``, ``stream`` (the answer as Responses events once it is
  sampled: the engine returns a turn whole).
- ``previous_response_id``: a response of the same episode is stored (unless ``store: false``)
  as its conversation (input and answer, instructions left out, as OpenAI carries them), which a
  later call's input continues: the same messages as sending the whole input, so the same branch.
- Refused with 400 naming the field: an unknown ``previous_response_id``, ``conversation`` (kept
  across episodes: send the input), ``background``, ``prompt``, ``top_logprobs``, ``max_tool_calls``, ``truncation: auto``, a ``text.format`` other
  than text, an ``include`` of log-probs, tools other than functions, a forced ``tool_choice``.
- The run's sampling applies: ``temperature``, ``top_p``, ``reasoning`` and the like are ignored.
"""

from __future__ import annotations

import time
import uuid
import weakref
from typing import Any

from fastapi import Request  # (module level: the route's annotations are resolved by name)
from fastapi.responses import JSONResponse, StreamingResponse

from asyncrl.agent.endpoint.api_common import chat_tool, positive_int, read_json, refuse, sse, text_of
from asyncrl.agent.endpoint.episode import Answer, EndpointError

_REFUSED = {"conversation": "conversations are not kept across episodes; send the input (or previous_response_id)",
            "background": "calls are answered in the foreground",
            "prompt": "prompt templates are not stored here; send instructions and input",
            "top_logprobs": "behaviour log-probs are the trainer's, not returned",
            "max_tool_calls": "the episode's limits are rollout.agent's (max_turns)"}
_PARTS = ("input_text", "output_text", "text", "refusal")
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens"}  # a chat-route error's field, renamed


_STORED: weakref.WeakKeyDictionary[Any, dict[str, list[dict]]] = weakref.WeakKeyDictionary()
"""Per episode (dropped with it): each stored response's conversation, for ``previous_response_id``."""


def to_chat(body: Any, earlier: list[dict] = ()) -> dict:
    """The ``chat/completions`` body a Responses request stands for, its input continuing ``earlier``
    (a previous response's conversation); 400 naming a refused field."""
    if not isinstance(body, dict):
        raise EndpointError(400, "the request body must be a JSON object")
    refuse(body, _REFUSED)
    if body.get("truncation") not in (None, "disabled"):
        raise EndpointError(400, "truncation=auto is not supported: a call past the context is refused, never cut",
                            param="truncation")
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    if fmt.get("type") != "text":
        raise EndpointError(400, "text.format must be text: structured output would change what the policy samples",
                            param="text.format")
    if any("logprobs" in str(i) for i in body.get("include") or ()):
        raise EndpointError(400, "include of log-probs is not supported: they are the trainer's", param="include")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise EndpointError(400, f"tool_choice={choice!r}: only auto or none (forcing a call would change what the "
                            "policy samples)", param="tool_choice")
    chat: dict = {"messages": _messages(body, list(earlier)), "tool_choice": choice}
    tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(body.get("tools") or ())]
    if tools:
        chat["tools"] = tools
    chat["max_tokens"] = positive_int(body, "max_output_tokens")
    return chat


def _tool(t: Any, where: str) -> dict:
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else t
        raise EndpointError(400, f"{where}.type={kind!r}: only function tools (run other tools in the agent)",
                            param=f"{where}.type")
    return chat_tool(t.get("name"), t.get("description"), t.get("parameters"), where)


def _messages(body: dict, earlier: list[dict]) -> list[dict]:
    """``instructions`` + ``earlier`` + ``input`` as chat messages (the module docstring)."""
    out: list[dict] = []
    if body.get("instructions"):
        if not isinstance(body["instructions"], str):
            raise EndpointError(400, "instructions must be a text", param="instructions")
        out.append({"role": "system", "content": body["instructions"]})
    out += earlier
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise EndpointError(400, "input must be a text or a non-empty list of items", param="input")
    assistant: dict | None = None  # the assistant message a function_call item joins
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("user", "system", "developer", "assistant"):
            m = {"role": item["role"], "content": text_of(item.get("content"), _PARTS, f"{where}.content")}
            out.append(m)
            assistant = m if m["role"] == "assistant" else None
        elif kind == "function_call":
            if assistant is None:
                assistant = {"role": "assistant", "content": None}
                out.append(assistant)
            assistant.setdefault("tool_calls", []).append(
                {"id": item.get("call_id"), "type": "function",
                 "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}})
        elif kind == "message":
            raise EndpointError(400, f"{where}.role must be user, system, developer or assistant, got "
                                f"{item.get('role')!r}", param=f"{where}.role")
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": text_of(item.get("output"), _PARTS, f"{where}.output")})
            assistant = None
        else:
            raise EndpointError(400, f"{where}: type={kind!r} is not supported (message items with role user, system, "
                                "developer or assistant; function_call; function_call_output)", param=f"{where}.type")
    return out


def response_body(request: dict, a: Answer, model: str) -> dict:
    """The ``response`` object of an answer (OpenAI's schema)."""
    msg, output = a.message, []
    done = "incomplete" if a.finish == "length" else "completed"
    if msg.get("content") or not msg.get("tool_calls"):
        output.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": done,
                       "content": [{"type": "output_text", "text": msg.get("content") or "", "annotations": [],
                                    "logprobs": []}]})
    for c in msg.get("tool_calls") or ():
        output.append({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": c["id"],
                       "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"})
    n_in, n_out = a.prompt_tokens, a.completion_tokens
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": time.time(), "status": done,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if done == "incomplete" else None,
            "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
            "model": model, "output": output, "parallel_tool_calls": request.get("parallel_tool_calls", True),
            "previous_response_id": request.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None}, "store": request.get("store") is not False,
            "temperature": None, "top_p": None, "text": {"format": {"type": "text"}},
            "tool_choice": request.get("tool_choice") or "auto", "tools": request.get("tools") or [],
            "truncation": "disabled", "metadata": request.get("metadata") or {}, "user": request.get("user"),
            "usage": {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": n_in + n_out}}


def stream_events(response: dict) -> list[dict]:
    """A finished response as the Responses API streams one (``sequence_number`` in order)."""
    start = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    events: list[dict] = [{"type": "response.created", "response": start},
                          {"type": "response.in_progress", "response": start}]
    for k, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": k}
        if item["type"] == "message":
            part = item["content"][0]
            events += [{"type": "response.output_item.added", "output_index": k,
                        "item": {**item, "status": "in_progress", "content": []}},
                       {"type": "response.content_part.added", **at, "content_index": 0, "part": {**part, "text": ""}},
                       {"type": "response.output_text.delta", **at, "content_index": 0, "delta": part["text"],
                        "logprobs": []},
                       {"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"],
                        "logprobs": []},
                       {"type": "response.content_part.done", **at, "content_index": 0, "part": part}]
        else:
            events += [{"type": "response.output_item.added", "output_index": k,
                        "item": {**item, "status": "in_progress", "arguments": ""}},
                       {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
                       {"type": "response.function_call_arguments.done", **at, "name": item["name"],
                        "arguments": item["arguments"]}]
        events.append({"type": "response.output_item.done", "output_index": k, "item": item})
    final = "response.completed" if response["status"] == "completed" else "response.incomplete"
    events.append({"type": final, "response": response})
    return [{**e, "sequence_number": n} for n, e in enumerate(events)]


def add_routes(app: Any, server: Any, serve_call: Any) -> None:
    """Register ``POST /s/{episode}/v1/responses`` on ``app`` (``serve_call``: the server's call runner)."""

    @app.post("/s/{episode}/v1/responses")
    async def responses(episode: str, request: Request):
        ep = server.lookup(episode, request.headers.get("authorization"))
        body = await read_json(request)
        stored = _STORED.setdefault(ep, {})
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if previous is not None and previous not in stored:
            raise EndpointError(400, f"previous_response_id={previous!r} is not a stored response of this episode "
                                "(responses are kept for their episode, unless store: false)",
                                param="previous_response_id")
        chat = to_chat(body, stored.get(previous, ()))
        server.calls += 1
        try:
            answer = await serve_call(server, ep, request, ep.answer(chat))
        except EndpointError as e:
            e.param = _PARAMS.get(e.param, e.param)
            raise
        out = response_body(body, answer, ep.model)
        if out["store"]:  # the conversation without this call's instructions (OpenAI does not carry them over)
            stored[out["id"]] = chat["messages"][1 if body.get("instructions") else 0:] + [answer.message]
        if not body.get("stream"):
            return JSONResponse(out)
        return StreamingResponse(sse(stream_events(out)), media_type="text/event-stream")
