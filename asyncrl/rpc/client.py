"""The caller's side: `link` a Ray handle to an `RpcActor`, whose ``actor.method.remote(...)``
sends at once over one `_Link` per event loop and actor of the `Links` it was made with (its
caller's: each caller owns one and passes it; there is no registry of the module's own)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

import zmq

from asyncrl.pump import Dispatch, unbounded
from asyncrl.rpc import auth, wire
from asyncrl.rpc.liveness import watch

log = logging.getLogger("asyncrl.rpc")


class OtherRunError(RuntimeError):
    """The actor signs its calls with another run's key: it is not one of this run's."""


class _Stream:
    """A streaming call's items as they arrive (one reader, the caller)."""

    __slots__ = ("call_id", "ended", "error", "items", "waiter")

    def __init__(self, call_id: int):
        self.call_id = call_id
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None
        self.ended = False
        self.error: BaseException | None = None

    def put(self, kind: int, value: Any) -> None:
        if kind == wire.ITEM:
            self.items.append(value)
        elif kind == wire.ERROR:
            self.ended, self.error = True, value
        else:
            self.ended = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def fail(self, exc: BaseException) -> None:
        self.put(wire.ERROR, exc)

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

    def __init__(self, endpoint: str, handle: Any, key: bytes, server_key: str | None = None,
                 curve: tuple[str, str] | None = None):
        self.loop = asyncio.get_running_loop()
        self._key = key
        self.rejected = 0
        """Replies dropped unread: not two frames, or a MAC that is not of this run."""
        sock = unbounded(zmq.Context.instance().socket(zmq.DEALER))
        if server_key is not None:  # another node's actor: CURVE, with its `Links`' key pair (``curve``)
            public, secret = curve
            sock.curve_serverkey = server_key.encode()
            sock.curve_publickey, sock.curve_secretkey = public.encode(), secret.encode()
        sock.connect(endpoint)
        self._pump = Dispatch(sock, self._on_reply)
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future | _Stream] = {}
        self.dead: BaseException | None = None
        self._watcher = self.loop.create_task(watch(handle, self._fail), name=f"rpc-link-watch {endpoint}")

    def send(self, key: Any, method: str, args: tuple, kwargs: dict, streaming: bool) -> asyncio.Future | _Stream:
        """The call, sent now: a future of its result, or (``streaming``) its `_Stream`."""
        if self.dead is not None:
            raise self.dead
        call_id = next(self._ids)
        payload = wire.call(call_id, key, method, args, kwargs, streaming)  # (a WireError: nothing sent)
        self._pump.send((auth.mac(self._key, payload, auth.CALL), payload))
        # (registered after the send: its reply is read on a later turn of this loop, never inside it)
        pending = self._pending[call_id] = _Stream(call_id) if streaming else self.loop.create_future()
        return pending

    def forget(self, stream: _Stream) -> None:
        """A streaming call whose caller stopped reading: items still to come are dropped."""
        self._pending.pop(stream.call_id, None)

    def _on_reply(self, frames: list) -> None:
        if len(frames) != 2 or not auth.authentic(self._key, frames[0], frames[1], auth.REPLY):
            self.rejected += 1  # (not of this run: e.g. another process on a dead actor's port)
            return
        try:
            call_id, kind, value = wire.decode(frames[1])
        except Exception as exc:  # noqa: BLE001 - the run's server sent what this end cannot read
            call_id, kind, value = wire.call_id(frames[1]), wire.ERROR, exc
        pending = self._pending.get(call_id)
        if pending is None:
            return  # its caller stopped waiting
        if isinstance(pending, _Stream):
            pending.put(kind, value)
            if kind != wire.ITEM:
                del self._pending[call_id]
            return
        del self._pending[call_id]
        if pending.done():
            return
        if kind == wire.ERROR:
            pending.set_exception(value)
        else:
            pending.set_result(value)

    def _fail(self, exc: BaseException) -> None:
        self.dead = exc
        pending, self._pending = self._pending, {}
        for p in pending.values():
            if isinstance(p, _Stream):
                p.fail(exc)
            elif not p.done():
                p.set_exception(exc)
        self._pump.close()

    def close(self) -> None:
        try:
            self._watcher.cancel()
        except RuntimeError:  # its event loop has closed
            pass
        self._pump.close()


class Links:
    """The links of one caller: a `_Link` per event loop and actor (an endpoint's port may serve a
    later actor once one is dead), and the CURVE key pair its links to other nodes' actors use.

    Whoever calls `link` owns one and passes it (the Rollouter's `EnginePool`, the aggregator, the
    weight-sync coordinator: a process each in a run), so its calls to an actor share one socket
    and one liveness watch; an `RpcActor` keeps the `Links` it was made with, and one made without
    (by hand, or unpickled in another process) makes its own.
    """

    def __init__(self) -> None:
        self._links: dict[tuple[int, str, str], _Link] = {}
        self._curve: tuple[str, str] | None = None

    def client_keys(self) -> tuple[str, str]:
        """The CURVE key pair (public, secret) of these links to actors of other nodes, made once."""
        if self._curve is None:
            self._curve = auth.curve_pair()
        return self._curve

    def to(self, actor: RpcActor) -> _Link:
        """The link of the running event loop to ``actor``, made at the first call."""
        loop = asyncio.get_running_loop()
        actor_id = getattr(actor.handle, "_actor_id", None)
        key = (id(loop), actor.endpoint, actor_id.hex() if actor_id is not None else repr(actor.handle))
        link = self._links.get(key)
        if link is None or link.loop is not loop:
            if actor.node is not None and actor.node != auth.node_ip():
                raise RuntimeError(f"an RpcActor made for the processes of node {actor.node} is used on node "
                                   f"{auth.node_ip()}: link the Ray handle there (asyncrl.rpc.link)")
            for k, old in list(self._links.items()):  # links of event loops that have ended (a test's, a run's)
                if old.loop.is_closed():
                    old.close()
                    del self._links[k]
            run_key = auth.run_key() if actor.secret is None else bytes.fromhex(actor.secret)
            curve = self.client_keys() if actor.server_key is not None else None
            link = self._links[key] = _Link(actor.endpoint, actor.handle, run_key, actor.server_key, curve)
        return link

    def close(self) -> None:
        """Close every link (calls in flight are left unanswered)."""
        links, self._links = self._links, {}
        for link_ in links.values():
            link_.close()


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
        try:
            return self.actor.links.to(self.actor).send(self.actor.key, self.name, args, kwargs, False)
        except BaseException as exc:  # noqa: BLE001 - a dead link, an argument that does not travel: where the result would be
            failed = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            return failed

    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """The items of an async-generator method as they come."""
        link = self.actor.links.to(self.actor)
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
    """A Ray actor handle's calls over ZeroMQ (`asyncrl.rpc`); ``handle`` is the Ray handle."""

    def __init__(self, handle: Any, endpoint: str, key: Any = None, server_key: str | None = None,
                 node: str | None = None, secret: str | None = None, links: Links | None = None):
        self.handle, self.endpoint, self.key, self.server_key = handle, endpoint, key, server_key
        self.node = node
        """The node whose processes this endpoint is for (None: any)."""
        self.secret = secret
        """The MAC key (hex) when not this process's run key (`auth.run_key`: None); never in repr."""
        self.links = links if links is not None else Links()
        """Where its calls go out: its caller's `Links` (not pickled: another process has its own)."""

    def on(self, links: Links) -> RpcActor:
        """This actor with its calls sent on ``links`` (a caller's: its calls to an actor share one socket)."""
        return RpcActor(self.handle, self.endpoint, self.key, self.server_key, self.node, self.secret, links)

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Method(self, name)

    def __reduce__(self):  # (a process of another node must ask `link` anew: the endpoint is per caller node)
        return RpcActor, (self.handle, self.endpoint, self.key, self.server_key, self.node, self.secret)

    def __repr__(self) -> str:
        return f"RpcActor({self.handle!r}, {self.endpoint!r}, key={self.key!r})"


async def link(target: Any, links: Links | None = None) -> Any:
    """``target``'s calls over ZeroMQ where it is a Ray actor that serves them (`Serving`): an
    `RpcActor` sending on ``links`` (the caller's; None: its own), on loopback for an actor of this
    node, CURVE for one of another; else ``target``. An `RpcActor` of this node (made elsewhere, or
    unpickled) is given back sending on ``links``. An actor of another run (another run key) is refused with
    an `OtherRunError` that says so."""
    if isinstance(target, RpcActor):
        # Moved onto the caller's links, so its calls share a socket with theirs; not a CURVE one:
        # its server admits only the key pair of the links it was made with.
        same = links is None or target.links is links or target.server_key is not None
        return target if same else target.on(links)
    from ray.actor import ActorHandle

    serve = getattr(getattr(target, "serve_rpc", None), "remote", None) if isinstance(target, ActorHandle) else None
    if serve is None:  # an in-process object (or a stand-in for a handle), or an actor that serves no endpoint
        return target
    links = links if links is not None else Links()
    here = auth.node_ip()
    served = await serve(here, links.client_keys()[0])
    ours = auth.key_id(auth.run_key())
    if served.get("run") != ours:
        raise OtherRunError(
            f"{target} takes the calls of another run (run key {served.get('run')}, this process's {ours}): every "
            f"process of a run needs its {auth.RUN_KEY_ENV}; asyncrl.placement starts Ray with it, a Ray started "
            "otherwise needs ray.init(runtime_env={'env_vars': asyncrl.rpc.run_env()})")
    return RpcActor(target, served["endpoint"], server_key=served.get("server_key"), node=here, links=links)


async def link_each(engines: Any, keys: Iterable[Any], timeout_s: float, links: Links | None = None) -> set[Any]:
    """`link` ``engines[k]`` on ``links`` (the caller's; None: one for these) for each key at once, each
    under ``timeout_s``, and put each link in its handle's place unless the handle was replaced
    meanwhile (a restarted replica): the keys linked. One that fails or does not answer is left as it
    is (a caller may try it again later)."""
    links = links if links is not None else Links()
    keys = list(keys)
    handles = [engines[k] for k in keys]
    outs = await asyncio.gather(*(asyncio.wait_for(link(h, links), timeout_s) for h in handles), return_exceptions=True)
    linked = set()
    for k, handle, out in zip(keys, handles, outs):
        if isinstance(out, OtherRunError):  # (a timeout or a dead actor is tried again later, unsaid)
            log.warning("rpc: %s stays called through Ray: %s", k, out)
        current = engines.get(k) if isinstance(engines, dict) else engines[k]  # (a dict's entry may be dropped)
        if not isinstance(out, BaseException) and current is handle:
            engines[k] = out
            linked.add(k)
    return linked
