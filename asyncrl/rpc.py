"""Calls to a Ray actor of the same node over ZeroMQ: Ray places the actor and watches it, the calls skip it.

A Ray actor call costs its caller about 0.5-1 ms of CPU, and a streaming call more per message
(`docs/scale.md`): at 128 engine replicas the Rollouter's group calls and the weight sync's
3 x 128 pause / update / resume calls fill a core with Ray's own work. Here a call is a pickled
message over a DEALER -> ROUTER pair of ZeroMQ sockets on loopback, answered in the actor's
own event loop.

- **Serving**: the actor (`EngineActor`, a benchmark's host of simulated replicas) makes an
  `RpcServer` in its event loop on its first ``serve_rpc`` call and returns its endpoint and
  node. The server resolves a call's ``key`` to the object whose method runs (None: the actor
  itself; an index: one of a host's replicas) and runs it as Ray would: an ``async`` method as
  a task of the actor's loop, so calls run concurrently; a plain one inline.
- **Calling**: `link` asks a handle for its endpoint (one Ray call per actor and process) and
  returns an `RpcActor`, a stand-in for the handle: ``actor.method.remote(*args)`` sends at once
  and returns an awaitable; ``actor.method.options(num_returns="streaming")`` and `calls.stream`
  give an async generator's items as they come. A handle of another node, or an object that
  serves no endpoint, is returned as it is: those calls stay on Ray. An `RpcActor` pickles as
  its handle and endpoint, so it can be handed to another process of the node.
- **Liveness**: each process's link to an endpoint keeps one Ray call to the actor open
  (``rpc_watch``, renewed each minute). When the actor dies that call fails with Ray's own
  error (`ray.exceptions.RayActorError`), and every call in flight on the link, and every later
  one, fails with it: callers tell a dead replica exactly as they do through Ray.
- **Order and loss**: one TCP connection per link, so calls start in the order sent (as Ray's
  from one caller do); socket high-water marks are off, so nothing is dropped.

Left out: calls across nodes (their endpoint would leave loopback; they go through Ray, which
authenticates its callers); cancelling a call does not stop it in the actor, as with Ray.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import itertools
import logging
import pickle
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq

log = logging.getLogger("asyncrl.rpc")

_ITEM, _RETURN, _ERROR = b"i", b"r", b"e"
WATCH_S = 60.0
"""How long one ``rpc_watch`` call waits in the actor before the link renews it."""


def _dumps(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _error_bytes(exc: BaseException) -> bytes:
    try:
        return _dumps(exc)
    except Exception:  # noqa: BLE001 - an exception that does not pickle still names itself
        return _dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


# ---------------------------------------------------------------------------------------- server


class _Socket:
    """A ZeroMQ socket read from the event loop's own selector: ``on_frames`` for each message,
    every waiting message at each wake (no future per message). The socket's descriptor signals
    edges, and a send may take one: after a send, a waiting message is read on the loop's next turn."""

    def __init__(self, sock: zmq.Socket, on_frames: Callable[[list], None]):
        self.sock, self.on_frames = sock, on_frames
        self.loop = asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._scheduled = False
        self.loop.add_reader(self._fd, self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        sock = self.sock
        while not sock.closed and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(zmq.NOBLOCK)
            try:
                self.on_frames(frames)
            except Exception:  # noqa: BLE001 - one bad message must not stop the socket
                log.exception("rpc: a message could not be handled")

    def send(self, frames) -> None:
        self.sock.send_multipart(frames)  # no high-water mark: never waits, never drops
        if not self._scheduled and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._scheduled = True
            self.loop.call_soon(self._drain)

    def close(self) -> None:
        if not self.sock.closed:
            if not self.loop.is_closed():
                self.loop.remove_reader(self._fd)
            self.sock.close(linger=0)


def _socket(kind: int) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class RpcServer:
    """A ROUTER socket on loopback in the running event loop; each call runs on ``resolve(key)``."""

    def __init__(self, resolve: Callable[[Any], Any]):
        self._resolve = resolve
        sock = _socket(zmq.ROUTER)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._tasks: set[asyncio.Task] = set()
        self._sock = _Socket(sock, self._on_call)

    def _on_call(self, frames: list) -> None:
        peer, cid, payload = frames
        try:
            key, method, args, kwargs, streaming = pickle.loads(payload)
            fn = getattr(self._resolve(key), method)
            if streaming:
                self._spawn(self._stream(peer, cid, fn(*args, **kwargs)))
                return
            out = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the caller's error, not the server's
            self._sock.send((peer, cid, _ERROR, _error_bytes(exc)))
            return
        if inspect.isawaitable(out):
            self._spawn(self._answer(peer, cid, out))
        else:
            self._sock.send((peer, cid, _RETURN, _dumps(out)))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, peer: bytes, cid: bytes, awaitable) -> None:
        try:
            out = _dumps(await awaitable)
        except Exception as exc:  # noqa: BLE001
            self._sock.send((peer, cid, _ERROR, _error_bytes(exc)))
        else:
            self._sock.send((peer, cid, _RETURN, out))

    async def _stream(self, peer: bytes, cid: bytes, items: AsyncIterator) -> None:
        try:
            async for item in items:
                self._sock.send((peer, cid, _ITEM, _dumps(item)))
        except Exception as exc:  # noqa: BLE001
            self._sock.send((peer, cid, _ERROR, _error_bytes(exc)))
        else:
            self._sock.send((peer, cid, _RETURN, _dumps(None)))

    def close(self) -> None:
        for task in list(self._tasks):
            if task is not asyncio.current_task():  # (a close called over this server)
                task.cancel()
        self._sock.close()


class Serving:
    """What an actor class adds to serve calls over ZeroMQ: ``serve_rpc`` and ``rpc_watch``.
    ``_rpc_resolve(key)`` names the object a call runs on (this one by default)."""

    _rpc_server: RpcServer | None = None

    def _rpc_resolve(self, key: Any) -> Any:
        return self

    async def serve_rpc(self) -> tuple[str, str]:
        """``(endpoint, node ip)``: this actor's calls over ZeroMQ, for processes of its node (`link`)."""
        if self._rpc_server is None:
            self._rpc_server = RpcServer(self._rpc_resolve)
        return self._rpc_server.endpoint, node_ip()

    async def rpc_watch(self, seconds: float) -> None:
        """Returns after ``seconds``; a link keeps one such call open to learn of this actor's death."""
        await asyncio.sleep(seconds)

    def close_rpc(self) -> None:
        if self._rpc_server is not None:
            self._rpc_server.close()
            self._rpc_server = None


# ---------------------------------------------------------------------------------------- client


class _Stream:
    """A streaming call's items as they arrive (one reader, the caller)."""

    __slots__ = ("cid", "items", "waiter", "ended", "error")

    def __init__(self):
        self.cid = -1
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.ended = False
        self.error: BaseException | None = None

    def put(self, kind: bytes, value: Any) -> None:
        if kind == _ITEM:
            self.items.append(value)
        elif kind == _ERROR:
            self.ended, self.error = True, value
        else:
            self.ended = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, exc: BaseException) -> None:
        self.put(_ERROR, exc)

    async def __aiter__(self):
        while True:
            while self.items:
                yield self.items.popleft()
            if self.ended:
                if self.error is not None:
                    raise self.error
                return
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
            self.waiter = None


class _Link:
    """One process's connection to one endpoint: the socket, the calls in flight, the liveness watch."""

    def __init__(self, endpoint: str, handle: Any):
        self.loop = asyncio.get_running_loop()
        sock = _socket(zmq.DEALER)
        sock.connect(endpoint)
        self._sock = _Socket(sock, self._on_reply)
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future | _Stream] = {}
        self.dead: BaseException | None = None
        self._watcher = self.loop.create_task(self._watch(handle), name=f"rpc-link-watch {endpoint}")

    def send(self, key: Any, method: str, args: tuple, kwargs: dict, streaming: bool) -> asyncio.Future | _Stream:
        """The call, sent now: a future of its result, or (``streaming``) its `_Stream`."""
        if self.dead is not None:
            raise self.dead
        cid = next(self._ids)
        if streaming:
            pending = _Stream()
            pending.cid = cid
        else:
            pending = self.loop.create_future()
        self._pending[cid] = pending
        self._sock.send((cid.to_bytes(8, "little"), _dumps((key, method, args, kwargs, streaming))))
        return pending

    def forget(self, stream: _Stream) -> None:
        """A streaming call whose caller stopped reading: items still to come are dropped."""
        self._pending.pop(stream.cid, None)

    def _on_reply(self, frames: list) -> None:
        cid, kind, payload = frames
        cid = int.from_bytes(cid, "little")
        pending = self._pending.get(cid)
        if pending is None:
            return  # its caller stopped waiting
        value = pickle.loads(payload)
        if isinstance(pending, _Stream):
            pending.put(kind, value)
            if kind != _ITEM:
                del self._pending[cid]
            return
        del self._pending[cid]
        if pending.done():
            return
        if kind == _ERROR:
            pending.set_exception(value)
        else:
            pending.set_result(value)

    async def _watch(self, handle: Any) -> None:
        try:
            while True:
                await handle.rpc_watch.remote(WATCH_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the actor is gone (Ray's error says how)
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.dead = exc
        pending, self._pending = self._pending, {}
        for p in pending.values():
            if isinstance(p, _Stream):
                p.fail(exc)
            elif not p.done():
                p.set_exception(exc)
        self._sock.close()

    def close(self) -> None:
        try:
            self._watcher.cancel()
        except RuntimeError:  # its event loop has closed
            pass
        self._sock.close()


_links: dict[tuple[int, str, str], _Link] = {}
"""(event loop's id, endpoint, actor id) -> `_Link`: one link per process, loop and actor (an
endpoint's port may serve a later actor once one is dead)."""


def _link_to(endpoint: str, handle: Any) -> _Link:
    loop = asyncio.get_running_loop()
    actor_id = getattr(handle, "_actor_id", None)
    key = (id(loop), endpoint, actor_id.hex() if actor_id is not None else repr(handle))
    link = _links.get(key)
    if link is None or link.loop is not loop:
        for k, old in list(_links.items()):  # links of event loops that have ended (a test's, a run's)
            if old.loop.is_closed():
                old.close()
                del _links[k]
        link = _links[key] = _Link(endpoint, handle)
    return link


class _Method:
    """``actor.method``: ``.remote(*args, **kwargs)``, ``.options(num_returns="streaming")``, ``.stream(*args)``."""

    __slots__ = ("actor", "name", "streaming")

    def __init__(self, actor: RpcActor, name: str, streaming: bool = False):
        self.actor, self.name, self.streaming = actor, name, streaming

    def options(self, num_returns: Any = None, **_: Any) -> _Method:
        return _Method(self.actor, self.name, streaming=num_returns == "streaming")

    def remote(self, *args: Any, **kwargs: Any):
        """Sent now; an awaitable of the result (a streaming call: an async iterator of awaitables, as Ray's)."""
        if self.streaming:
            return _awaitables(self.stream(*args, **kwargs))
        link = self.actor._link()
        try:
            return link.send(self.actor.key, self.name, args, kwargs, False)
        except BaseException as exc:  # a dead link: the error comes out where the result would
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            return failed

    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """The items of an async-generator method as they come."""
        link = self.actor._link()
        stream = link.send(self.actor.key, self.name, args, kwargs, True)
        try:
            async for item in stream:
                yield item
        finally:
            link.forget(stream)


async def _awaitables(items: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for item in items:
        done = asyncio.get_running_loop().create_future()
        done.set_result(item)
        yield done


class RpcActor:
    """A Ray actor handle's calls over ZeroMQ (see the module docstring); ``handle`` is the Ray handle."""

    def __init__(self, handle: Any, endpoint: str, key: Any = None):
        self.handle, self.endpoint, self.key = handle, endpoint, key

    def _link(self) -> _Link:
        return _link_to(self.endpoint, self.handle)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Method(self, name)

    def __reduce__(self):
        return RpcActor, (self.handle, self.endpoint, self.key)

    def __repr__(self) -> str:
        return f"RpcActor({self.handle!r}, {self.endpoint!r}, key={self.key!r})"


async def link(target: Any) -> Any:
    """``target``'s calls over ZeroMQ where it is a Ray actor that serves them on this node (an
    `RpcActor`); else ``target`` itself."""
    if isinstance(target, RpcActor):
        return target
    from ray.actor import ActorHandle

    serve = getattr(getattr(target, "serve_rpc", None), "remote", None) if isinstance(target, ActorHandle) else None
    if serve is None:  # an in-process object (or a stand-in for a handle), or an actor that serves no endpoint
        return target
    endpoint, node = await serve()
    if node != node_ip():
        return target  # another node: through Ray
    return RpcActor(target, endpoint)
