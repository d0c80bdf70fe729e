"""The actor's side: `RpcServer` answers calls in the actor's event loop; `Serving` is what an
actor class mixes in to serve them (``serve_rpc``, ``rpc_watch``)."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq

from asyncrl.pump import Dispatch, unbounded
from asyncrl.rpc import auth, wire
from asyncrl.rpc.liveness import hold

log = logging.getLogger("asyncrl.rpc")


class RpcServer:
    """A ROUTER socket in the running event loop; each call runs on ``resolve(key)``.

    On loopback by default. With ``curve``, a CURVE server on ``host`` (a node's address, for
    callers on other nodes): encrypted, and only the client keys in ``admitted.keys`` complete the
    handshake (a ZAP handler on a context of its own). Calls and replies carry MACs under ``key``
    (the run's key: `auth.run_key`)."""

    def __init__(self, resolve: Callable[[Any], Any], host: str = "127.0.0.1", curve: bool = False,
                 key: bytes | None = None):
        self._resolve = resolve
        self._key = auth.run_key() if key is None else key
        self.run = auth.key_id(self._key)
        """The name of the run whose calls this server takes (`auth.key_id`)."""
        self.rejected = 0
        """Messages dropped unread: not two frames and a peer, or a MAC that is not of this run."""
        self.malformed = 0
        """Messages of this run that could not be read (a bug: answered with the error when possible)."""
        self._ctx = self._auth = None
        self.server_key: str | None = None
        self.admitted = auth.Admitted()
        if curve:
            from zmq.auth.thread import ThreadAuthenticator

            self._ctx = zmq.Context()
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback(domain=auth.ZAP_DOMAIN, credentials_provider=self.admitted)
        sock = unbounded((self._ctx or zmq.Context.instance()).socket(zmq.ROUTER))
        if curve:
            public, secret = zmq.curve_keypair()
            self.server_key = public.decode()
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = public, secret
            sock.zap_domain = auth.ZAP_DOMAIN.encode()
        port = sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._tasks: set[asyncio.Task] = set()
        self._pump = Dispatch(sock, self._on_call)

    def _send(self, peer: bytes, call_id: int, kind: int, value: Any) -> None:
        if self._pump.sock.closed:  # (an answer to a call that closed this server)
            return
        payload = wire.reply(call_id, kind, value)
        self._pump.send((peer, auth.mac(self._key, payload, auth.REPLY), payload))

    # -- calls -----------------------------------------------------------------------------

    def _on_call(self, frames: list) -> None:
        if len(frames) != 3 or not auth.authentic(self._key, frames[1], frames[2], auth.CALL):
            self._reject(frames)
            return  # no answer: a caller outside the run learns nothing, not even an error
        peer, _, payload = frames
        try:
            call_id, key, method, args, kwargs, streaming = wire.decode(payload)
        except Exception as exc:  # noqa: BLE001 - the run's own caller sent what this end cannot read
            self._malformed(peer, payload, exc)
            return
        try:
            fn = getattr(self._resolve(key), method)
            if streaming:
                self._spawn(self._stream(peer, call_id, fn(*args, **kwargs)))
                return
            out = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the caller's error, not the server's
            self._send(peer, call_id, wire.ERROR, exc)
            return
        if inspect.isawaitable(out):
            self._spawn(self._answer(peer, call_id, out))
        else:
            self._send(peer, call_id, wire.RETURN, out)

    def _reject(self, frames: list) -> None:
        self.rejected += 1
        if self.rejected == 1:  # once per server: a caller outside the run must not fill the log
            log.warning("rpc %s: dropped a message without a MAC of this run (%d frames); "
                        "later ones are counted in RpcServer.rejected", self.endpoint, len(frames))

    def _malformed(self, peer: bytes, payload: bytes, exc: Exception) -> None:
        self.malformed += 1
        log.error("rpc %s: a call of this run could not be read: %s", self.endpoint, exc)
        call_id = wire.call_id(payload)
        if call_id is not None:
            self._send(peer, call_id, wire.ERROR, exc)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, peer: bytes, call_id: int, awaitable) -> None:
        try:
            out = await awaitable
        except Exception as exc:  # noqa: BLE001
            self._send(peer, call_id, wire.ERROR, exc)
        else:
            self._send(peer, call_id, wire.RETURN, out)

    async def _stream(self, peer: bytes, call_id: int, items: AsyncIterator) -> None:
        try:
            async for item in items:
                self._send(peer, call_id, wire.ITEM, item)
        except Exception as exc:  # noqa: BLE001
            self._send(peer, call_id, wire.ERROR, exc)
        else:
            self._send(peer, call_id, wire.RETURN, None)

    def close(self) -> None:
        for task in list(self._tasks):
            if task is not asyncio.current_task():  # (a close called over this server)
                task.cancel()
        self._pump.close()
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
        ``run``, the name of the run key its messages are signed with (`auth.key_id`: the key
        itself never travels), so that a caller of another run is told at once."""
        here = auth.node_ip()
        if caller_node is None or caller_node == here:
            if self._rpc_server is None:
                self._rpc_server = RpcServer(self._rpc_resolve)
            return {"endpoint": self._rpc_server.endpoint, "node": here, "run": self._rpc_server.run}
        if caller_key is None:
            raise ValueError("serve_rpc: a caller on another node must give its CURVE public key (caller_key)")
        if self._rpc_remote is None:
            self._rpc_remote = RpcServer(self._rpc_resolve, host=here, curve=True)
        self._rpc_remote.admitted.keys.add(caller_key.encode())
        return {"endpoint": self._rpc_remote.endpoint, "node": here, "server_key": self._rpc_remote.server_key,
                "run": self._rpc_remote.run}

    async def rpc_watch(self, seconds: float) -> None:
        """Returns after ``seconds``; a link keeps one such call open to learn of this actor's death."""
        await hold(seconds)

    def close_rpc(self) -> None:
        for server in (self._rpc_server, self._rpc_remote):
            if server is not None:
                server.close()
        self._rpc_server = self._rpc_remote = None
