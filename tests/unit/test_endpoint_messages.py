"""Anthropic's Messages API on the episode endpoint over real HTTP (httpx, exact JSON; the
``anthropic`` package is not a dependency): a two-call tool episode echoing the first answer's
blocks is ONE token-exact trajectory; streaming events; stop sequences; each refused field a 400
naming it; a wrong ``x-api-key`` 401."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.unit.endpoint_helpers import RENDERER, ScriptedLLM, serving
from tests.unit.test_endpoint_responses import CALL, assert_one_exact_trajectory

TOOLS = [{"name": "mul", "description": "multiply",
          "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]


async def post(server, ep, body: dict, *, key: str | None = None, bearer: bool = False, path: str = "messages"):
    headers = {"authorization": f"Bearer {key or ep.secret}"} if bearer else {"x-api-key": key or ep.secret}
    async with httpx.AsyncClient(timeout=30) as h:
        return await h.post(f"{server.url}/s/{ep.id}/v1/{path}", json=body,
                            headers={**headers, "anthropic-version": "2023-06-01"})


async def test_a_tool_episode_over_messages_is_one_exact_trajectory():
    llm = ScriptedLLM(["Let me see." + CALL, "It is 42."])
    async with serving(llm) as (server, ep):
        first = [{"role": "user", "content": "6*7?"}]
        system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
        r = await post(server, ep, {"model": "claude", "max_tokens": 64, "system": system, "messages": first,
                                    "tools": TOOLS, "temperature": 0.2})
        assert r.status_code == 200
        body = r.json()
        use_id = body["content"][1]["id"]
        assert body == {"id": body["id"], "type": "message", "role": "assistant", "model": "policy",
                        "content": [{"type": "text", "text": "Let me see."},
                                    {"type": "tool_use", "id": use_id, "name": "mul", "input": {"a": 6, "b": 7}}],
                        "stop_reason": "tool_use", "stop_sequence": None,
                        "usage": {"input_tokens": len(llm.prompts[0]), "output_tokens": len(llm.turns[0])}}
        assert body["id"].startswith("msg_") and use_id.startswith("toolu_")
        echo = [{"role": "assistant", "content": body["content"]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use_id, "content": "42"}]}]
        r2 = await post(server, ep, {"model": "claude", "max_tokens": 64, "system": system, "messages": first + echo,
                                     "tools": TOOLS}, bearer=True)
        assert r2.json()["content"] == [{"type": "text", "text": "It is 42."}] and r2.json()["stop_reason"] == "end_turn"
    assert_one_exact_trajectory(ep, llm)


async def test_streaming_stop_sequences_max_tokens_and_count_tokens():
    llm = ScriptedLLM(["Let me." + CALL, "abc STOP def", "one two three four five six"])
    async with serving(llm) as (server, ep):
        user = [{"role": "user", "content": [{"type": "text", "text": "6*7?"}]}]
        r = await post(server, ep, {"max_tokens": 64, "messages": user, "tools": TOOLS, "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in r.text.split("\n\n") if f]
        events = [json.loads(f.split("\ndata: ", 1)[1]) for f in frames]
        assert [f.split("\n", 1)[0] for f in frames] == [f"event: {e['type']}" for e in events]
        assert [e["type"] for e in events] == ["message_start"] + ["content_block_start", "content_block_delta",
                                                                    "content_block_stop"] * 2 + ["message_delta",
                                                                                                 "message_stop"]
        assert events[2]["delta"] == {"type": "text_delta", "text": "Let me."}
        assert events[4]["content_block"]["name"] == "mul" and events[4]["content_block"]["input"] == {}
        assert json.loads(events[5]["delta"]["partial_json"]) == {"a": 6, "b": 7}
        assert events[7]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
        assert events[7]["usage"] == {"output_tokens": len(llm.turns[0])}
        stopped = (await post(server, ep, {"max_tokens": 64, "messages": [{"role": "user", "content": "s"}],
                                           "stop_sequences": ["STOP"]})).json()
        assert stopped["content"] == [{"type": "text", "text": "abc "}]
        assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == "STOP"
        cut = (await post(server, ep, {"max_tokens": 3, "messages": [{"role": "user", "content": "n"}]})).json()
        assert cut["stop_reason"] == "max_tokens" and cut["usage"]["output_tokens"] == 3
        counted = await post(server, ep, {"messages": user, "system": "sys"}, path="messages/count_tokens")
        want = RENDERER.prompt_ids([{"role": "system", "content": "sys"}, {"role": "user", "content": "6*7?"}], ())
        assert counted.json() == {"input_tokens": len(want)} and ep.calls == 3


@pytest.mark.parametrize("change, param", [
    ({"max_tokens": None}, "max_tokens"), ({"stream": None, "max_tokens": 0}, "max_tokens"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"), ({"tools": [{"type": "web_search_20250305", "name": "w"}]},
                                                         "tools[0].type"),
    ({"mcp_servers": [{"type": "url", "url": "http://x"}]}, "mcp_servers"), ({"stop_sequences": [""]}, "stop_sequences"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "system", "content": "s"}]}, "messages[0].role"),
])
async def test_each_refused_field_is_a_400_naming_it(change, param):
    llm = ScriptedLLM()
    async with serving(llm) as (server, ep):
        body = {k: v for k, v in {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **change}.items()
                if v is not None}
        r = await post(server, ep, body)
    assert r.status_code == 400 and r.headers["x-should-retry"] == "false"
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(param)  # the message names the field first
    assert llm.prompts == [] and ep.calls == 0


async def test_a_wrong_key_is_401_an_unknown_episode_404_an_ended_one_409():
    llm = ScriptedLLM(["x"])
    async with serving(llm) as (server, ep):
        body = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        wrong = await post(server, ep, body, key="sk-wrong")
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        assert (await post(server, ep, body, key="sk-wrong", bearer=True)).status_code == 401
        async with httpx.AsyncClient() as h:
            r = await h.post(f"{server.url}/s/nope/v1/messages", json=body, headers={"x-api-key": ep.secret})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        server.remove(ep, "the agent returned")
        assert (await post(server, ep, body)).status_code == 409
    assert llm.prompts == []

