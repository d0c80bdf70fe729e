"""One default TLS context for the HTTP clients an in-process agent builds per episode.

An OpenAI client (``openai.AsyncOpenAI``, LangChain's ``ChatOpenAI``, the Agents SDK's model)
builds an httpx client, and every httpx client builds its own default ``ssl.SSLContext``, which
reads the whole CA bundle: about 57 ms of CPU on a 2-core x86 VM, many times what the episode's
calls to the endpoint cost. An agent handed a new base URL per episode builds a client per
episode, so a function agent (it runs in the Rollouter's process) would spend that on the
Rollouter's event loop for every episode, stalling the other episodes and the engines: the
calculator demo through ``examples/openai_agent`` took 4.4x the wall time of the built-in ``Env``.

`share_default_tls_context` makes the default context (``verify=True``, no client certificate,
the same ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``) built once per process and shared by every httpx
client built after it; one ``SSLContext`` may serve any number of connections. Any other
``verify`` (False, a path, the user's own context) is built as before. The endpoint itself is
plain HTTP on loopback: the context is never used to talk to it, only built.
"""

from __future__ import annotations

import importlib
import os
import threading
from typing import Any

_lock = threading.Lock()
_installed: set[str] = set()


def share_default_tls_context() -> list[str]:
    """Install the shared default context in ``httpx`` and ``httpx2`` (the fork newer ``openai``
    releases use), whichever are importable; idempotent. Returns the modules patched so far."""
    with _lock:
        for name in ("httpx", "httpx2"):
            if name in _installed:
                continue
            try:
                transports = importlib.import_module(f"{name}._transports.default")
            except ImportError:
                continue
            build = getattr(transports, "create_ssl_context", None)
            if build is None:  # a release that builds its contexts elsewhere: leave it alone
                continue
            transports.create_ssl_context = _shared(build)
            _installed.add(name)
        return sorted(_installed)


def _shared(build: Any) -> Any:
    cache: dict[tuple, Any] = {}

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> Any:
        if verify is not True or cert is not None:
            return build(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        ctx = cache.get(key)
        if ctx is None:
            ctx = cache[key] = build(verify=True, cert=None, trust_env=trust_env)
        return ctx

    create_ssl_context.shared = True  # type: ignore[attr-defined]
    return create_ssl_context
