"""Third-party clients against the episode endpoint, where installed: the OpenAI Agents SDK
(streamed, over the Responses API) and the ``anthropic`` client (over the Messages API; not a
dependency: tests/unit/test_endpoint_messages.py pins the JSON). Each client's own echo of an
answer maps to the sampled ids: one token-exact trajectory."""

from __future__ import annotations

import pytest

from tests.unit.endpoint_helpers import ScriptedLLM, client, serving
from tests.unit.test_endpoint_messages import TOOLS as ANTHROPIC_TOOLS
from tests.unit.test_endpoint_responses import CALL, assert_one_exact_trajectory


async def test_the_openai_agents_sdk_streamed_is_one_exact_trajectory():
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def mul(a: int, b: int) -> int:
        """multiply"""
        return a * b

    llm = ScriptedLLM(["Let me see." + CALL, "It is 42."])
    async with serving(llm) as (server, ep):
        model = agents.OpenAIResponsesModel(model="policy", openai_client=client(server, ep))
        run = agents.Runner.run_streamed(agents.Agent(name="calc", instructions="Be brief.", tools=[mul], model=model),
                                         "6*7?")
        async for _ in run.stream_events():
            pass
    assert run.final_output == "It is 42."
    assert_one_exact_trajectory(ep, llm)  # the SDK's own echo of the output items maps to the sampled ids


async def test_the_anthropic_client_where_installed():
    anthropic = pytest.importorskip("anthropic")  # not a dependency: the tests above pin the JSON
    llm = ScriptedLLM(["Let me see." + CALL, "It is 42."])
    async with serving(llm) as (server, ep):
        c = anthropic.AsyncAnthropic(base_url=f"{server.url}/s/{ep.id}", api_key=ep.secret, max_retries=0)
        msgs = [{"role": "user", "content": "6*7?"}]
        kwargs = {"model": "m", "max_tokens": 64, "system": "Be brief.", "tools": ANTHROPIC_TOOLS}
        async with c.messages.stream(messages=msgs, **kwargs) as s:
            r = await s.get_final_message()
        assert r.stop_reason == "tool_use" and r.content[1].input == {"a": 6, "b": 7}
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": r.content[1].id,
                                               "content": "42"}]}]
        r2 = await c.messages.create(messages=msgs, **kwargs)
        assert r2.content[0].text == "It is 42."
        with pytest.raises(anthropic.AuthenticationError):
            await c.with_options(api_key="sk-wrong").messages.create(model="m", max_tokens=8, messages=msgs)
    assert_one_exact_trajectory(ep, llm)
