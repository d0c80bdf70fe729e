"""Train an agent unchanged: an OpenAI-compatible endpoint per episode, token-exact (docs/endpoint.md).

`EndpointServer` (the HTTP server, in the endpoint's process or on the Rollouter's event loop:
`asyncrl.agent.endpoint.host`), `Episode` (one episode's calls and limits), `History`
(token-exact branches), `EndpointLoop` (a user's ``function`` or ``command`` as an `AgentLoop`),
`ClientSpec` (what a function agent gets).
"""

from __future__ import annotations

from asyncrl._lazy import lazy_exports

_EXPORTS = {
    "ClientSpec": "asyncrl.agent.endpoint.loop",
    "EndpointLoop": "asyncrl.agent.endpoint.loop",
    "EpisodeFailed": "asyncrl.agent.endpoint.loop",
    "EndpointServer": "asyncrl.agent.endpoint.server",
    "Episode": "asyncrl.agent.endpoint.episode",
    "EpisodeLimits": "asyncrl.agent.endpoint.episode",
    "EndpointError": "asyncrl.agent.endpoint.episode",
    "History": "asyncrl.agent.endpoint.history",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
