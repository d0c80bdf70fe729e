"""Who may call and answer: the run's key, the MAC every message carries, CURVE for other nodes.

**The run's key.** One secret (32 random bytes) per run, made where the run starts and handed
to every process of it through Ray: ``ASYNCRL_RUN_KEY`` (hex) in the environment of the Ray
job's workers (`run_env`, merged into ``runtime_env`` by `asyncrl.placement`). Every message
either way carries a keyed BLAKE2b MAC of its bytes under that key, checked before anything of
it is decoded; a call's MAC and a reply's are made apart (BLAKE2's personalization), so neither
can stand for the other. A process outside the run, or a server or caller of another run
(another key), gets nothing run and nothing accepted.

**Other nodes.** A caller of another node reaches the actor's CURVE endpoint (encrypted); its
ZAP handler admits only the CURVE public keys callers registered through Ray (``serve_rpc``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

RUN_KEY_ENV = "ASYNCRL_RUN_KEY"
"""The environment variable that holds the run's key (64 hex digits)."""
CALL, REPLY = b"asyncrl-call", b"asyncrl-reply"
"""The MAC's personalization of a call and of a reply."""
ZAP_DOMAIN = "asyncrl-rpc"


def run_key() -> bytes:
    """This run's key: ``ASYNCRL_RUN_KEY`` from the environment, as the run's Ray gives it to every
    process; a process without one (the launcher, a test) makes it and puts it there, so a local
    Ray it starts afterwards (`asyncrl.placement`) gives its workers the same key."""
    value = os.environ.get(RUN_KEY_ENV)
    if value is None:
        value = os.environ[RUN_KEY_ENV] = secrets.token_hex(32)
    try:
        key = bytes.fromhex(value)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise ValueError(f"{RUN_KEY_ENV} must be 64 hex digits (the run's key, 32 bytes), got {len(value)} "
                         "characters: unset it and the launcher makes one")
    return key


def new_run_key() -> bytes:
    """A fresh key for the run this process starts (the launcher, at its start), in its environment."""
    os.environ[RUN_KEY_ENV] = secrets.token_hex(32)
    return run_key()


def run_env() -> dict[str, str]:
    """What a Ray job's ``runtime_env["env_vars"]`` adds so that every process of the run has its key."""
    return {RUN_KEY_ENV: run_key().hex()}


def key_id(key: bytes) -> str:
    """A name of ``key`` that tells runs apart and gives nothing of it away (a one-way hash)."""
    return hashlib.blake2b(key, digest_size=8, person=b"asyncrl-run-id").hexdigest()


def mac(key: bytes, payload: bytes, person: bytes) -> bytes:
    """The payload's keyed BLAKE2b MAC (BLAKE2's keyed mode is a MAC by design; one C call, about
    half HMAC-SHA256's cost on short messages)."""
    return hashlib.blake2b(payload, key=key, digest_size=32, person=person).digest()


def authentic(key: bytes, tag: bytes, payload: bytes, person: bytes) -> bool:
    return hmac.compare_digest(tag, mac(key, payload, person))


class Admitted:
    """The ZAP check of a CURVE server: only the public keys its callers registered over Ray pass."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()

    def callback(self, domain: str, client_key: bytes) -> bool:
        return client_key in self.keys


def curve_pair() -> tuple[str, str]:
    """A new CURVE key pair (public, secret) for a caller's calls to actors of other nodes (each
    `asyncrl.rpc.Links` makes one, at its first such link)."""
    import zmq

    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def node_ip() -> str:
    """This process's node address (a caller of another node gets the CURVE endpoint)."""
    import ray

    return ray.util.get_node_ip_address()
