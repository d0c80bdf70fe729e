"""`share_default_tls_context`: the HTTP clients an in-process agent builds per episode share one
default TLS context instead of each reading the CA bundle (tests the real httpx/openai clients)."""

import ssl

import httpx
import pytest

from asyncrl.agent.endpoint.tls import share_default_tls_context


def _ctx(client: httpx.AsyncClient) -> ssl.SSLContext:
    return client._transport._pool._ssl_context


@pytest.mark.asyncio
async def test_default_clients_share_one_context_and_other_verify_settings_are_kept():
    assert "httpx" in share_default_tls_context()
    assert share_default_tls_context() == share_default_tls_context()  # idempotent
    async with httpx.AsyncClient() as a, httpx.AsyncClient() as b:
        assert _ctx(a) is _ctx(b)
        assert _ctx(a).verify_mode == ssl.CERT_REQUIRED and _ctx(a).check_hostname
    async with httpx.AsyncClient(verify=False) as off:
        assert _ctx(off) is not _ctx(a) and _ctx(off).verify_mode == ssl.CERT_NONE
    own = ssl.create_default_context()
    async with httpx.AsyncClient(verify=own) as mine:
        assert _ctx(mine) is own


@pytest.mark.asyncio
async def test_openai_clients_built_per_episode_share_it():
    openai = pytest.importorskip("openai")
    share_default_tls_context()
    seen = set()
    for ep in range(3):
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:1/s/{ep}/v1", api_key=f"k{ep}") as client:
            seen.add(id(client._client._transport._pool._ssl_context))
    assert len(seen) == 1
