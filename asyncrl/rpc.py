"""Calls to Ray actors over ZeroMQ: Ray places the actor and watches it, the calls skip Ray.

A Ray actor call costs its caller about 0.6 ms of CPU, and a streaming call more per message
(`docs/scale.md`): at 128 engine replicas the Rollouter's group calls and the weight sync's
3 x 128 pause / update / resume calls filled a core with Ray's own work. Here a call is a pickled
message over a DEALER -> ROUTER pair of ZeroMQ sockets, answered in the actor's own event loop
(about a tenth of a Ray call's CPU to the caller when calls overlap).

- **Serving**: an actor class mixes in `Serving`. Its ``serve_rpc`` (called through Ray, which
  authenticates the caller) makes an `RpcServer` in the actor's event loop: on loopback for a
  caller of the actor's node; for a caller of another node, a CURVE server on the node's
  address (encrypted; the ZAP handler admits only the client keys callers registered through
  ``serve_rpc``). A call's ``key`` names the object its method runs on (None: the actor itself;
  an index: one of a benchmark host's replicas). An ``async`` method runs as a task of the
  actor's loop, so calls run concurrently as Ray runs them; a plain one inline.
- **Calling**: `link` asks a Ray handle for its endpoint once per process and returns an
  `RpcActor`, a stand-in for the handle: ``actor.method.remote(*args)`` sends at once and returns
  a future; ``actor.method.options(num_returns="streaming")`` (as Ray's) and `calls.stream` give an
  async generator's items as they come. Anything else (an in-process engine, a test's stand-in
  for a handle) is returned as it is. An `RpcActor` pickles as its handle and endpoint, for
  another process of the same node; on another node it refuses to link (link the handle there).
- **Liveness**: each process's link to an actor keeps one Ray call to it open (``rpc_watch``,
  renewed each minute). When the actor dies that call fails with Ray's own error
  (`ray.exceptions.RayActorError`), and every call in flight on the link, and every later one,
  fails with it: callers tell a dead replica exactly as they do through Ray.
- **Admission**: each server makes a secret (32 random bytes) and hands it out only in
  ``serve_rpc``'s answer, that is through Ray. Every message either way carries a keyed BLAKE2b
  MAC of its payload under that secret, checked before the payload is unpickled; a message
  without a valid MAC is dropped unanswered and counted (``RpcServer.rejected``,
  ``_Link.rejected``). A local process outside the run can connect to the port, but nothing it
  sends is unpickled or run (`docs/security.md`).
- **Order and loss**: one TCP connection per link, so calls start in the order sent (as Ray's
  from one caller do); high-water marks are off, so nothing is dropped.

Left out: cancelling a call does not stop it in the actor (as with Ray); a caller whose CURVE
handshake fails (a key never registered) waits, as a call to a hung actor does, for its deadline.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import inspect
import itertools
import logging
import pickle
import secrets
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import zmq

log = logging.getLogger("asyncrl.rpc")

_ITEM, _RETURN, _ERROR = b"i", b"r", b"e"
_ZAP_DOMAIN = "asyncrl-rpc"
WATCH_S = 60.0
"""How long one ``rpc_watch`` call waits in the actor before the link renews it."""


def _mac(secret: bytes, payload: bytes) -> bytes:
    """The payload's keyed BLAKE2b MAC (BLAKE2's keyed mode is a MAC by design; one C call, about
    half HMAC-SHA256's cost on short messages)."""
    return hashlib.blake2b(payload, key=secret, digest_size=32).digest()


def _authentic(secret: bytes, mac: bytes, payload: bytes) -> bool:
    return hmac.compare_digest(mac, _mac(secret, payload))


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
        if self.sock.closed:  # (an answer to a call that closed this server, or a dead link's)
            return
        self.sock.send_multipart(frames)  # no high-water mark: never waits, never drops
        if not self._scheduled and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._scheduled = True
            self.loop.call_soon(self._drain)

    def close(self) -> None:
        if not self.sock.closed:
            if not self.loop.is_closed():
                self.loop.remove_reader(self._fd)
            self.sock.close(linger=0)


def _socket(kind: int, ctx: zmq.Context | None = None) -> zmq.Socket:
    sock = (ctx or zmq.Context.instance()).socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class _Admitted:
    """The ZAP check of a CURVE server: only the public keys its callers registered over Ray pass."""

    def __init__(self):
        self.keys: set[bytes] = set()

    def callback(self, domain: str, client_key: bytes) -> bool:
        return client_key in self.keys


class RpcServer:
    """A ROUTER socket in the running event loop; each call runs on ``resolve(key)``.

    On loopback by default. With ``curve``, a CURVE server on ``host`` (a node's address, for
    callers on other nodes): encrypted, and only the client keys in ``admitted.keys`` complete the
    handshake (a ZAP handler on a context of its own)."""

    def __init__(self, resolve: Callable[[Any], Any], host: str = "127.0.0.1", curve: bool = False):
        self._resolve = resolve
        self.secret = secrets.token_bytes(32)
        """What a caller's MAC is keyed with; given out only through Ray (``serve_rpc``)."""
        self.rejected = 0
        """Messages dropped unread: not three frames, or a MAC that is not this server's."""
        self._ctx = self._auth = None
        self.server_key: str | None = None
        self.admitted = _Admitted()
        if curve:
            from zmq.auth.thread import ThreadAuthenticator

            self._ctx = zmq.Context()
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback(domain=_ZAP_DOMAIN, credentials_provider=self.admitted)
        sock = _socket(zmq.ROUTER, self._ctx)
        if curve:
            public, secret = zmq.curve_keypair()
            self.server_key = public.decode()
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = public, secret
            sock.zap_domain = _ZAP_DOMAIN.encode()
        port = sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._tasks: set[asyncio.Task] = set()
        self._sock = _Socket(sock, self._on_call)

    def _on_call(self, frames: list) -> None:
        if len(frames) != 4 or not _authentic(self.secret, frames[2], frames[3]):
            self._reject(frames)
            return  # no answer: a caller outside the run learns nothing, not even an error
        peer, cid, _, payload = frames
        try:
            key, method, args, kwargs, streaming = pickle.loads(payload)
            fn = getattr(self._resolve(key), method)
            if streaming:
                self._spawn(self._stream(peer, cid, fn(*args, **kwargs)))
                return
            out = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the caller's error, not the server's
            self._send(peer, cid, _ERROR, _error_bytes(exc))
            return
        if inspect.isawaitable(out):
            self._spawn(self._answer(peer, cid, out))
        else:
            self._send(peer, cid, _RETURN, _dumps(out))

    def _reject(self, frames: list) -> None:
        self.rejected += 1
        if self.rejected == 1:  # once per server: a caller outside the run must not fill the log
            log.warning("rpc %s: dropped a message without this server's MAC (%d frames); "
                        "later ones are counted in RpcServer.rejected", self.endpoint, len(frames))

    def _send(self, peer: bytes, cid: bytes, kind: bytes, body: bytes) -> None:
        self._sock.send((peer, cid, kind, _mac(self.secret, body), body))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, peer: bytes, cid: bytes, awaitable) -> None:
        try:
            out = _dumps(await awaitable)
        except Exception as exc:  # noqa: BLE001
            self._send(peer, cid, _ERROR, _error_bytes(exc))
        else:
            self._send(peer, cid, _RETURN, out)

    async def _stream(self, peer: bytes, cid: bytes, items: AsyncIterator) -> None:
        try:
            async for item in items:
                self._send(peer, cid, _ITEM, _dumps(item))
        except Exception as exc:  # noqa: BLE001
            self._send(peer, cid, _ERROR, _error_bytes(exc))
        else:
            self._send(peer, cid, _RETURN, _dumps(None))

    def close(self) -> None:
        for task in list(self._tasks):
            if task is not asyncio.current_task():  # (a close called over this server)
                task.cancel()
        self._sock.close()
        if self._auth is not None:
            self._auth.stop()
            self._ctx.term()


class Serving:
    """What an actor class adds to serve calls over ZeroMQ: ``serve_rpc`` and ``rpc_watch``.
    ``_rpc_resolve(key)`` names the object a call runs on (this one by default)."""

    _rpc_server: RpcServer | None = None
    _rpc_remote: RpcServer | None = None

    def _rpc_resolve(self, key: Any) -> Any:
        return self

    async def serve_rpc(self, caller_node: str | None = None, caller_key: str | None = None) -> dict:
        """Where to call this actor over ZeroMQ (`link`): ``{"endpoint"}`` on loopback for a caller
        of this node; for one of another node, the CURVE endpoint on this node's address and
        ``server_key``, ``caller_key`` (a CURVE public key) admitted from now on. Either way
        ``secret`` (hex), the key of every message's MAC. This call comes through Ray: only the
        run's processes learn the secret."""
        here = node_ip()
        if caller_node is None or caller_node == here:
            if self._rpc_server is None:
                self._rpc_server = RpcServer(self._rpc_resolve)
            return {"endpoint": self._rpc_server.endpoint, "node": here, "secret": self._rpc_server.secret.hex()}
        if caller_key is None:
            raise ValueError("serve_rpc: a caller on another node must give its CURVE public key (caller_key)")
        if self._rpc_remote is None:
            self._rpc_remote = RpcServer(self._rpc_resolve, host=here, curve=True)
        self._rpc_remote.admitted.keys.add(caller_key.encode())
        return {"endpoint": self._rpc_remote.endpoint, "node": here, "server_key": self._rpc_remote.server_key,
                "secret": self._rpc_remote.secret.hex()}

    async def rpc_watch(self, seconds: float) -> None:
        """Returns after ``seconds``; a link keeps one such call open to learn of this actor's death."""
        await asyncio.sleep(seconds)

    def close_rpc(self) -> None:
        for server in (self._rpc_server, self._rpc_remote):
            if server is not None:
                server.close()
        self._rpc_server = self._rpc_remote = None


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

    def __init__(self, endpoint: str, handle: Any, secret: bytes, server_key: str | None = None):
        self.loop = asyncio.get_running_loop()
        self._secret = secret
        self.rejected = 0
        """Replies dropped unread: not three frames, or a MAC that is not the server's."""
        sock = _socket(zmq.DEALER)
        if server_key is not None:  # another node's actor: CURVE, with this process's keys
            public, secret = client_keys()
            sock.curve_serverkey = server_key.encode()
            sock.curve_publickey, sock.curve_secretkey = public.encode(), secret.encode()
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
        payload = _dumps((key, method, args, kwargs, streaming))
        self._sock.send((cid.to_bytes(8, "little"), _mac(self._secret, payload), payload))
        return pending

    def forget(self, stream: _Stream) -> None:
        """A streaming call whose caller stopped reading: items still to come are dropped."""
        self._pending.pop(stream.cid, None)

    def _on_reply(self, frames: list) -> None:
        if len(frames) != 4 or not _authentic(self._secret, frames[2], frames[3]):
            self.rejected += 1  # (not the server's: e.g. another process on a dead actor's port)
            return
        cid, kind, _, payload = frames
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


_client_keys: tuple[str, str] | None = None


def client_keys() -> tuple[str, str]:
    """This process's CURVE key pair (public, secret) for calls to actors of other nodes, made once."""
    global _client_keys
    if _client_keys is None:
        public, secret = zmq.curve_keypair()
        _client_keys = public.decode(), secret.decode()
    return _client_keys


def _link_to(endpoint: str, handle: Any, secret: str, server_key: str | None, node: str | None) -> _Link:
    loop = asyncio.get_running_loop()
    actor_id = getattr(handle, "_actor_id", None)
    key = (id(loop), endpoint, actor_id.hex() if actor_id is not None else repr(handle))
    link = _links.get(key)
    if link is None or link.loop is not loop:
        if node is not None and node != node_ip():
            raise RuntimeError(f"an RpcActor made for the processes of node {node} is used on node {node_ip()}: "
                               "link the Ray handle there (asyncrl.rpc.link)")
        for k, old in list(_links.items()):  # links of event loops that have ended (a test's, a run's)
            if old.loop.is_closed():
                old.close()
                del _links[k]
        link = _links[key] = _Link(endpoint, handle, bytes.fromhex(secret), server_key)
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

    def __init__(self, handle: Any, endpoint: str, key: Any = None, server_key: str | None = None,
                 node: str | None = None, secret: str | None = None):
        self.handle, self.endpoint, self.key, self.server_key = handle, endpoint, key, server_key
        self.node = node
        """The node whose processes this endpoint is for (None: any)."""
        self.secret = secret
        """The server's MAC key (hex), from ``serve_rpc``'s answer; never in repr."""

    def _link(self) -> _Link:
        if self.secret is None:
            raise ValueError(f"RpcActor for {self.endpoint}: secret is required, the one serve_rpc answered "
                             "(RpcActor(..., secret=served['secret']), or make it with asyncrl.rpc.link)")
        return _link_to(self.endpoint, self.handle, self.secret, self.server_key, self.node)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Method(self, name)

    def __reduce__(self):  # (a process of another node must ask `link` anew: the endpoint is per caller node)
        return RpcActor, (self.handle, self.endpoint, self.key, self.server_key, self.node, self.secret)

    def __repr__(self) -> str:
        return f"RpcActor({self.handle!r}, {self.endpoint!r}, key={self.key!r})"


async def link(target: Any) -> Any:
    """``target``'s calls over ZeroMQ where it is a Ray actor that serves them (`Serving`): an
    `RpcActor` (on loopback for an actor of this node, CURVE for one of another); else ``target``."""
    if isinstance(target, RpcActor):
        return target
    from ray.actor import ActorHandle

    serve = getattr(getattr(target, "serve_rpc", None), "remote", None) if isinstance(target, ActorHandle) else None
    if serve is None:  # an in-process object (or a stand-in for a handle), or an actor that serves no endpoint
        return target
    here = node_ip()
    served = await serve(here, client_keys()[0])
    return RpcActor(target, served["endpoint"], server_key=served.get("server_key"), node=here,
                    secret=served["secret"])


async def link_each(engines: Any, keys: Iterable[Any], timeout_s: float) -> set[Any]:
    """`link` ``engines[k]`` for each key at once, each under ``timeout_s``, and put each link in its
    handle's place unless the handle was replaced meanwhile (a restarted replica): the keys linked.
    One that fails or does not answer is left as it is (a caller may try it again later)."""
    keys = list(keys)
    handles = [engines[k] for k in keys]
    links = await asyncio.gather(*(asyncio.wait_for(link(h), timeout_s) for h in handles), return_exceptions=True)
    linked = set()
    for k, handle, out in zip(keys, handles, links):
        current = engines.get(k) if isinstance(engines, dict) else engines[k]  # (a dict's entry may be dropped)
        if not isinstance(out, BaseException) and current is handle:
            engines[k] = out
            linked.add(k)
    return linked
