"""`asyncrl.agent.endpoint.fastpath`: which requests it answers itself (the generation routes, as
FastAPI's ``/s/{episode}/v1/...`` match them), and that its JSON answers are byte-for-byte the
FastAPI app's for the same content (an answer, an `EndpointError` with its ``x-should-retry``)."""

import asyncio

import pytest
from fastapi.responses import JSONResponse

from asyncrl.agent.endpoint.episode import EndpointError
from asyncrl.agent.endpoint.fastpath import route_of, send_json
from asyncrl.agent.endpoint.server import _NO_RETRY


def _scope(path: str, method: str = "POST") -> dict:
    return {"type": "http", "method": method, "path": path, "headers": []}


@pytest.mark.parametrize("path,route", [
    ("/s/ep-1/v1/chat/completions", ("ep-1", "chat")),
    ("/s/ep-1/v1/completions", ("ep-1", "complete")),
    ("/s/ep-1/v1/chat/completions/", None),  # FastAPI redirects a trailing slash: left to it
    ("/s//v1/completions", None),
    ("/s/ep-1/v1/models", None),
    ("/s/ep-1/reward", None),
    ("/s/ep-1/v1/reward", None),
    ("/s/ep-1/v2/completions", None),
    ("/x/ep-1/v1/completions", None),
    ("/s/a/b/v1/completions", None),
])
def test_only_the_generation_routes_are_taken(path, route):
    assert route_of(_scope(path)) == route
    assert route_of(_scope(path, "GET")) is None
    assert route_of({**_scope(path), "type": "websocket"}) is None


async def _sent(send_to) -> list[dict]:
    out = []

    async def send(message):
        out.append(message)

    await send_to(send)
    return out


@pytest.mark.parametrize("status,content,headers", [
    (200, {"id": "chatcmpl-1", "choices": [{"message": {"content": "héllo \u2603 \"q\"", "tool_calls": None}}],
           "usage": {"prompt_tokens": 3}}, None),
    (409, EndpointError(409, "episode e has ended (x)", code="episode_ended").body(), _NO_RETRY),
])
def test_json_answers_are_the_same_bytes_as_starlette(status, content, headers):
    ours = asyncio.run(_sent(lambda send: send_json(send, status, content, headers)))
    theirs = asyncio.run(_sent(lambda send: JSONResponse(content, status_code=status, headers=headers)(
        {"type": "http"}, None, send)))
    assert ours[0]["status"] == theirs[0]["status"] == status
    assert sorted(ours[0]["headers"]) == sorted(theirs[0]["headers"])
    assert ours[1]["body"] == theirs[1]["body"]
