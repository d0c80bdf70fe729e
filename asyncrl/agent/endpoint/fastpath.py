"""The endpoint's two generation routes as a plain ASGI app in front of the FastAPI one.

``POST /s/{episode}/v1/chat/completions`` and ``POST /s/{episode}/v1/completions`` are nearly
every request an agent makes. Through FastAPI each paid for its routing, its dependency solving
(pydantic validation of the path parameter and the ``Request``), its exception and exit-stack
middleware: on ``scripts/bench_scale.py --agent --http`` that was about as much CPU as the
episode's own work (history matching, rendering, the engine call). `FastPath` is the one
implementation of those two routes (the FastAPI app has none): the lookup, the `EndpointError`
answers (status, body and ``x-should-retry``), JSON compact and UTF-8 as Starlette renders it (read
and written with ``orjson``: the stdlib's ``json`` was ~9% of the endpoint process's CPU on the
bench), the SSE stream, and what Starlette's router would answer around them (405 ``{"detail":
"Method Not Allowed"}`` with ``allow: POST`` for another method, a 307 to the path without its
trailing slash). Every other request (``models``, ``reward``, the Responses and Messages routes) goes to
the FastAPI app unchanged.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import orjson

from asyncrl.agent.endpoint.episode import EndpointError

_METHODS = {("chat", "completions"): "chat", ("completions",): "complete"}
"""The path after ``/s/{episode}/v1/``, split at ``/``: the `Episode` method serving it."""


def match(path: str) -> tuple[str, str] | None:
    """(episode, `Episode` method) of a generation route's path (as Starlette matches a
    ``/s/{episode}/v1/...`` route: the episode one non-empty path segment), else None."""
    parts = path.split("/")
    if len(parts) < 5 or parts[0] or parts[1] != "s" or not parts[2] or parts[3] != "v1":
        return None
    method = _METHODS.get(tuple(parts[4:]))
    return None if method is None else (parts[2], method)


def header(scope: dict, name: bytes) -> str | None:
    """A request header (names arrive lowercased), as Starlette decodes it."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def read_json(receive: Any) -> Any:
    """The request body parsed as JSON (400 if it is not)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise EndpointError(499, "the client disconnected; its request was aborted")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    try:
        return orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError:  # (invalid UTF-8 too; NaN and Infinity are not JSON: refused)
        raise EndpointError(400, "the request body is not JSON") from None


async def send_json(send: Any, status: int, content: Any, headers: dict[str, str] | None = None) -> None:
    """One JSON answer, compact UTF-8 as Starlette's ``JSONResponse`` renders it."""
    body = orjson.dumps(content)
    raw = [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]
    raw += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class FastPath:
    """ASGI app: the generation routes served directly (the module docstring), the rest by ``app``.
    ``serve_call``, ``stream`` and ``error_headers``: the server module's own (`_serve_call`,
    `stream_response`, ``_NO_RETRY``), handed in (that module imports this one)."""

    def __init__(self, server: Any, app: Any, *, serve_call: Any, stream: Any, error_headers: dict[str, str]):
        self.server, self.app = server, app
        self.serve_call, self.stream, self.error_headers = serve_call, stream, error_headers

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        route = match(scope["path"]) if scope["type"] == "http" else None
        if route is None:
            if scope["type"] == "http" and _redirected(scope):
                return await _redirect(scope, receive, send)
            return await self.app(scope, receive, send)
        if scope["method"] != "POST":  # as Starlette answers a path whose route takes other methods
            return await send_json(send, 405, {"detail": "Method Not Allowed"}, {"allow": "POST"})
        server = self.server
        try:
            ep = server.lookup(route[0], header(scope, b"authorization"))
            body = await read_json(receive)
            server.calls += 1
            answer = await self.serve_call(server, ep, SimpleNamespace(receive=receive), getattr(ep, route[1])(body))
        except EndpointError as e:
            server.errors += 1
            return await send_json(send, e.status, e.body(), self.error_headers)
        if not body.get("stream"):
            return await send_json(send, 200, answer)
        await self.stream(answer, body)(scope, receive, send)


def _redirected(scope: dict) -> bool:
    """A generation route's path with trailing slashes: Starlette's router redirects it (any method)."""
    path = scope["path"]
    return path.endswith("/") and path != "/" and match(path.rstrip("/")) is not None


async def _redirect(scope: dict, receive: Any, send: Any) -> None:
    """Starlette's ``redirect_slashes`` answer: 307 to the same URL less its trailing slashes."""
    from starlette.datastructures import URL
    from starlette.responses import RedirectResponse

    await RedirectResponse(url=str(URL(scope={**scope, "path": scope["path"].rstrip("/")})))(scope, receive, send)
