"""ZeroMQ CURVE for the sample stream: keys made per run, one helper applying them to a socket.

For every run, on loopback too, the launcher makes two key pairs (`make_curve_keys`): the
consumer's (server) and the producers' (client). Both travel to the processes as Ray actor
arguments (never on a command line or in a file). The consumer's socket is a CURVE server that
also runs a ZAP handler admitting only the run's client key; a producer's socket is a CURVE
client that must know the consumer's public key. A peer without the keys cannot complete the
handshake, so it can neither deliver nor read a group; every failed handshake is counted
(`CurveGuard.rejected`, surfaced as ``ConsumerStats.rejected_peers``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import zmq


@dataclass(frozen=True, kw_only=True)
class CurveKeys:
    """Z85 CURVE keys of one run. A producer gets them without ``server_secret`` (`for_producer`)."""

    server_public: str
    server_secret: str | None = None
    client_public: str
    client_secret: str

    def for_producer(self) -> CurveKeys:
        return replace(self, server_secret=None)


def make_curve_keys() -> CurveKeys:
    """Fresh server and client key pairs (libzmq's CSPRNG)."""
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return CurveKeys(server_public=server_public.decode(), server_secret=server_secret.decode(),
                     client_public=client_public.decode(), client_secret=client_secret.decode())


ZAP_DOMAIN = "asyncrl-stream"
_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class CurveGuard:
    """The server side's ZAP handler (only the run's client key passes) and a count of failed handshakes."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, keys: CurveKeys,
                 on_reject: Callable[[], None] | None = None):
        from zmq.auth.thread import ThreadAuthenticator

        self.rejected = 0
        self._on_reject = on_reject
        self._allowed = keys.client_public.encode()
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)
        self._monitor = sock.get_monitor_socket(_FAILED)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._count, name="stream-curve-monitor", daemon=True)
        self._thread.start()

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP: admit the run's producers only."""
        return client_key == self._allowed

    def _count(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        poller = zmq.Poller()
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(100):
                try:
                    event = recv_monitor_message(self._monitor)
                except zmq.ZMQError:
                    return
                if event["event"] & _FAILED:
                    self.rejected += 1
                    if self._on_reject is not None:
                        self._on_reject()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._monitor.close(linger=0)
        self._auth.stop()


def apply_curve(sock: zmq.Socket, keys: CurveKeys, *, server: bool) -> None:
    """Make ``sock`` a CURVE server (consumer) or client (producer) with the run's keys; before bind/connect."""
    if server:
        if keys.server_secret is None:
            raise ValueError("a CURVE server needs CurveKeys.server_secret (the consumer's keys, not for_producer())")
        sock.curve_server = True
        sock.curve_publickey = keys.server_public.encode()
        sock.curve_secretkey = keys.server_secret.encode()
        sock.zap_domain = ZAP_DOMAIN.encode()
    else:
        sock.curve_serverkey = keys.server_public.encode()
        sock.curve_publickey = keys.client_public.encode()
        sock.curve_secretkey = keys.client_secret.encode()
