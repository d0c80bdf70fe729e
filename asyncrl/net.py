"""Loopback helpers shared by the parts that open sockets."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (for a rendezvous, a stream endpoint).

    Another process may take it before the caller binds it; callers that bind it at once
    (the stream, a process-group store) rarely lose that race.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
