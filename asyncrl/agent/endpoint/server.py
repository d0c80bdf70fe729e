"""The OpenAI-compatible HTTP server: one per Rollouter process, one path per episode.

``{server}/s/{episode}/v1``: ``POST chat/completions``, ``POST completions``, ``GET models``;
``POST {server}/s/{episode}/reward`` (``{"reward": x}``) for an agent that scores itself. The
API key (``Authorization: Bearer ...``) is the episode's secret: a wrong one is 401, an unknown
episode 404, a call after its episode ended 409.

Why FastAPI/Starlette on uvicorn: a maintained ASGI stack that parses HTTP/1.1 in C
(httptools), speaks SSE through a plain streaming response, and runs as a coroutine
(``uvicorn.Server.serve``) on an event loop we own: the endpoint process's
(`asyncrl.agent.endpoint.process`, the default) or the Rollouter's own
(``rollout.agent.endpoint_server: loop``, `asyncrl.agent.endpoint.host.LoopHost`). Either way a
call awaits its episode's `LLM`, which is the Rollouter's `RolloutLLM` (over the socket pair from
the endpoint process), so the pause-keep across a weight sync, per-token versions and partial
rollout apply to it as to any agent turn. The server binds
loopback unless ``rollout.agent.endpoint_host`` says otherwise (agents in sandboxes on other
hosts); the episode secret is its authentication. The two generation routes are served by
`asyncrl.agent.endpoint.fastpath` alone, a plain ASGI app in front of the FastAPI app (FastAPI's
per-request cost was about a call's own work); the app serves the rest.

A client that disconnects before its answer cancels the call, which aborts its engine request;
nothing of it is recorded. The engine returns a turn whole, so ``stream: true`` sends the
answer as OpenAI's chunks once it is sampled (role, content, one delta per tool call, the
finish reason, usage when ``stream_options.include_usage``, ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import socket
import time
from collections import OrderedDict
from typing import Any

from fastapi import FastAPI, Request  # (module level: the routes' annotations are resolved by name)
from fastapi.responses import JSONResponse, StreamingResponse

from asyncrl.agent.endpoint.episode import EndpointError, Episode
from asyncrl.agent.endpoint.fastpath import FastPath

log = logging.getLogger("asyncrl.agent.endpoint")
_ENDED_KEPT = 100_000  # ended episodes remembered for a 409 (beyond: 404)
_NO_RETRY = {"x-should-retry": "false"}  # the openai client retries 409/429/5xx otherwise; none would help


class EndpointServer:
    """Serves the episodes `add`-ed to it; `start` binds and serves as a task it owns, `close` stops it."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, public_host: str | None = None):
        self.host, self.port = host, port
        self.public_host = public_host or (host if host not in ("0.0.0.0", "::") else _node_address())
        self.episodes: dict[str, Episode] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self.calls = 0
        self.errors = 0

    @property
    def url(self) -> str:
        return f"http://{self.public_host}:{self.port}"

    def base_url(self, episode: Episode) -> str:
        return f"{self.url}/s/{episode.id}/v1"

    async def start(self) -> None:
        """Bind (the port is known before serving: no readiness race) and serve on this event loop."""
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(4096)
        self.port = sock.getsockname()[1]
        app = FastPath(self, build_app(self), serve_call=_serve_call, stream=stream_response, error_headers=_NO_RETRY)
        # proxy_headers off: no route reads the client's address, and uvicorn's middleware for
        # X-Forwarded-For would otherwise wrap every request.
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, proxy_headers=False,
                                timeout_graceful_shutdown=5, backlog=4096, timeout_keep_alive=60,
                                http=_one_write_protocol())
        self._server = _OwnedServer(config)
        config.load()  # (here, not in the task: what it imports is frozen below)
        if gc.get_freeze_count():  # a process whose start-up is frozen (the Rollouter's: `settle_gc`)
            # What the server's start imported and built lives as long as the process: frozen too, or
            # every full collection walks these ~20,000 objects again.
            gc.collect()
            gc.freeze()
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="asyncrl-endpoint")

    async def close(self) -> None:
        """Stop serving (every open episode ends) and await the server task."""
        for ep in list(self.episodes.values()):
            self.remove(ep, "the server closed")
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, 30)
        finally:
            self._task = None

    def add(self, episode: Episode) -> None:
        self.episodes[episode.id] = episode

    def remove(self, episode: Episode, why: str) -> None:
        """End ``episode``: its later calls get 409."""
        episode.end(why)
        if self.episodes.pop(episode.id, None) is not None:
            self.ended[episode.id] = why
            if len(self.ended) > _ENDED_KEPT:
                self.ended.popitem(last=False)

    def lookup(self, episode_id: str, authorization: str | None) -> Episode:
        ep = self.episodes.get(episode_id)
        if ep is None:
            if episode_id in self.ended:
                raise EndpointError(409, f"episode {episode_id} has ended ({self.ended[episode_id]})", code="episode_ended")
            raise EndpointError(404, f"no episode {episode_id} on this endpoint (the path is /s/<episode>/v1)")
        key = (authorization or "").removeprefix("Bearer ").strip()
        if key != ep.secret:
            raise EndpointError(401, f"wrong API key for episode {episode_id} (use the key the episode was given: "
                                "OPENAI_API_KEY / ClientSpec.api_key)", code="invalid_api_key")
        return ep


def _node_address() -> str:
    """This node's address as other hosts reach it (Ray's view where Ray runs), for a wildcard bind."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


def _one_write_protocol() -> type:
    """uvicorn's httptools protocol (the one it picks itself where httptools is installed, as here),
    its answers written through `_OneWrite`."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class OneWriteProtocol(HttpToolsProtocol):
        def connection_made(self, transport):  # type: ignore[override]
            super().connection_made(_OneWrite(transport))

    return OneWriteProtocol


class _OneWrite:
    """A connection's transport whose writes within one event-loop turn leave in one send.

    uvicorn writes an answer's head and its body apart: two sends, two TCP segments on a socket with
    Nagle off, which the client reads and parses apart (two wake-ups of its event loop). Our answers
    are whole when sent (the fast path's head and body in one step), so the first write of a turn
    is held and sent at the end of that turn (``call_soon``) with whatever followed it; a stream's
    head goes out the same way, alone if no chunk came in that turn. ``close`` sends what is held
    first. Everything else is the transport's own."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport):
        self._transport, self._loop = transport, asyncio.get_running_loop()
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._held is None:
            self._held = bytes(data)
            self._loop.call_soon(self._send)
        else:
            self._held += data

    def _send(self) -> None:
        data, self._held = self._held, None
        if data and not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._send()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _OwnedServer:
    """``uvicorn.Server`` without its signal handlers: the process's own shutdown owns SIGINT/SIGTERM."""

    def __new__(cls, config):
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        return Server(config)


async def _until_disconnect(receive) -> None:
    """Returns when the client goes away (uvicorn answers ``receive`` then, once the body is read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _serve_call(server: EndpointServer, ep: Episode, request: Any, call) -> dict:
    """Run ``call`` as a task of the episode; a client disconnect cancels it (its engine request is aborted).

    Callbacks, not ``asyncio.wait`` and ``gather``: this runs once per call, and those built a
    waiter, a gathering future and callbacks on both tasks, and took a loop turn more per call."""
    task = asyncio.create_task(call)
    ep.in_flight.add(task)
    gone = asyncio.create_task(_until_disconnect(request.receive))
    gone.add_done_callback(lambda _: task.cancel())  # the client left (after the call: a no-op)
    try:
        return await task
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling() or not task.cancelled():
            raise  # this request itself is cancelled (the server stops): not the call's doing
    finally:
        ep.in_flight.discard(task)
        gone.cancel()
    if ep.ended is not None:  # cancelled by its episode's end
        raise EndpointError(409, f"episode {ep.id} ended during the call ({ep.ended})", code="episode_ended")
    raise EndpointError(499, "the client disconnected; its request was aborted")


def _chunks(body: dict, include_usage: bool) -> list[dict]:
    """A finished answer as OpenAI's stream chunks (chat or text completion)."""
    base = {"id": body["id"], "created": body["created"], "model": body["model"]}
    choice = body["choices"][0]
    if body["object"] == "text_completion":
        out = [{**base, "object": "text_completion",
                "choices": [{"index": 0, "text": choice["text"], "finish_reason": None, "logprobs": None}]},
               {**base, "object": "text_completion",
                "choices": [{"index": 0, "text": "", "finish_reason": choice["finish_reason"], "logprobs": None}]}]
    else:
        msg = choice["message"]

        def chunk(delta: dict, finish: str | None = None) -> dict:
            return {**base, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

        out = [chunk({"role": "assistant", "content": ""})]
        if msg.get("content"):
            out.append(chunk({"content": msg["content"]}))
        for i, call in enumerate(msg.get("tool_calls") or ()):
            out.append(chunk({"tool_calls": [{"index": i, **call}]}))
        out.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        out.append({**base, "object": out[0]["object"], "choices": [], "usage": body["usage"]})
    return out


def stream_response(answer: dict, body: dict) -> StreamingResponse:
    """``answer`` as the SSE stream a ``stream: true`` request gets."""
    usage = bool((body.get("stream_options") or {}).get("include_usage"))

    async def sse():
        for c in _chunks(answer, usage):
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(sse(), media_type="text/event-stream")


def build_app(server: EndpointServer):
    """The FastAPI app of ``server``: every route of the module docstring but the two generation
    routes, which `FastPath` (in front of it) alone serves."""
    app = FastAPI(title="asyncrl episode endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(EndpointError)
    async def _error(_: Request, e: EndpointError):
        server.errors += 1
        return JSONResponse(e.body(), status_code=e.status, headers=_NO_RETRY)

    async def body_of(request: Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise EndpointError(400, "the request body is not JSON") from None

    @app.get("/s/{episode}/v1/models")
    async def models(episode: str, request: Request):
        ep = server.lookup(episode, request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": ep.model, "object": "model", "created": int(time.time()),
                                            "owned_by": "asyncrl"}]}

    @app.post("/s/{episode}/reward")
    @app.post("/s/{episode}/v1/reward")
    async def reward(episode: str, request: Request):
        ep = server.lookup(episode, request.headers.get("authorization"))
        return {"reward": ep.post_reward(await body_of(request))}

    from asyncrl.agent.endpoint import messages_api, responses_api  # (docs/endpoint.md)

    responses_api.add_routes(app, server, _serve_call)
    messages_api.add_routes(app, server, _serve_call)
    return app
