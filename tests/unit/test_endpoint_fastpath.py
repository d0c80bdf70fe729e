"""`asyncrl.agent.endpoint.fastpath`: which paths it answers itself (the generation routes, as
Starlette's ``/s/{episode}/v1/...`` match them), and that its JSON answers are byte-for-byte the
FastAPI app's for the same content (an answer, an `EndpointError` with its ``x-should-retry``)."""

import asyncio

import pytest
from fastapi.responses import JSONResponse

from asyncrl.agent.endpoint.episode import EndpointError
from asyncrl.agent.endpoint.fastpath import match, send_json
from asyncrl.agent.endpoint.server import _NO_RETRY


@pytest.mark.parametrize("path,route", [
    ("/s/ep-1/v1/chat/completions", ("ep-1", "chat")),
    ("/s/ep-1/v1/completions", ("ep-1", "complete")),
    ("/s/ep-1/v1/chat/completions/", None),  # a trailing slash is redirected (test_endpoint.py's served tests)
    ("/s//v1/completions", None),
    ("/s/ep-1/v1/models", None),
    ("/s/ep-1/reward", None),
    ("/s/ep-1/v1/reward", None),
    ("/s/ep-1/v2/completions", None),
    ("/x/ep-1/v1/completions", None),
    ("/s/a/b/v1/completions", None),
])
def test_only_the_generation_routes_are_taken(path, route):
    # (another method on these routes gets the fast path's 405, tested on the served app)
    assert match(path) == route


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


def _reference_app():
    """What the FastAPI app answered when it still had the generation routes (a stand-in handler)."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/s/{episode}/v1/chat/completions")
    @app.post("/s/{episode}/v1/completions")
    async def generate(episode: str):
        return {"episode": episode}

    return app


@pytest.mark.parametrize("method,path", [
    ("GET", "/s/ep-test/v1/chat/completions"),
    ("PUT", "/s/ep-test/v1/completions"),
    ("POST", "/s/ep-test/v1/chat/completions/"),
    ("GET", "/s/ep-test/v1/completions//"),
    ("POST", "/s/ep-test/v1/chat/completions/x"),
])
async def test_around_the_routes_the_served_app_answers_as_starlette(method, path):
    """The fast path is the generation routes' one implementation: another method (405), a trailing
    slash (307) and a longer path (404) get the answers Starlette's router gave for them."""
    import httpx

    from tests.unit.endpoint_helpers import ScriptedLLM, serving

    async with serving(ScriptedLLM()) as (server, _):
        async with httpx.AsyncClient(base_url=server.url) as ours, \
                httpx.AsyncClient(transport=httpx.ASGITransport(app=_reference_app()), base_url=server.url) as theirs:
            a, b = await ours.request(method, path, json={}), await theirs.request(method, path, json={})
    assert a.status_code == b.status_code and a.content == b.content
    for name in ("allow", "location", "content-type", "content-length"):
        assert a.headers.get(name) == b.headers.get(name), name
    assert a.status_code in (307, 404, 405)


def test_the_fastapi_app_has_no_generation_routes():
    """The FastAPI app behind the fast path serves the rest only (no second implementation of the two)."""
    from asyncrl.agent.endpoint.server import EndpointServer, build_app

    paths = {getattr(r, "path", None) for r in build_app(EndpointServer()).routes}
    assert "/s/{episode}/v1/models" in paths and "/s/{episode}/v1/responses" in paths
    assert not {"/s/{episode}/v1/chat/completions", "/s/{episode}/v1/completions"} & paths


async def test_an_answers_head_and_body_leave_in_one_send():
    """uvicorn writes an answer's head and body apart; the endpoint's connections (`_OneWrite`) send
    what one event-loop turn wrote in one send, at the end of that turn, and `close` sends what is
    held before closing. A real socket transport, its sends noted."""
    import socket

    from asyncrl.agent.endpoint.server import _OneWrite

    loop = asyncio.get_running_loop()
    ours, peer = socket.socketpair()
    transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
    sends: list[bytes] = []

    class Noted:
        def write(self, data):
            sends.append(bytes(data))
            transport.write(data)

        def __getattr__(self, name):
            return getattr(transport, name)

    conn = _OneWrite(Noted())
    conn.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
    conn.write(b"body")
    assert sends == [] and conn.get_extra_info("socket") is not None  # held until the turn ends; the rest is the transport's
    await asyncio.sleep(0)
    assert sends == [b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nbody"]
    await asyncio.sleep(0)
    assert len(sends) == 1  # nothing held: nothing more sent
    conn.write(b"data: last\n\n")
    conn.close()
    assert sends[-1] == b"data: last\n\n" and transport.is_closing()
    peer.settimeout(5)
    got = b""
    while chunk := await loop.run_in_executor(None, peer.recv, 4096):
        got += chunk
    peer.close()
    assert got == b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nbodydata: last\n\n"
