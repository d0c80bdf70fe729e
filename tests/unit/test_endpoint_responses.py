"""OpenAI's Responses API on the episode endpoint, with the real ``openai`` client (sync and async,
streaming): a two-call tool episode echoing the first answer's output items is ONE token-exact
trajectory; each refused field is a 400 naming it; a wrong key is 401."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.unit.endpoint_helpers import RENDERER, TOK, ScriptedLLM, client, serving

CALL = '<tool_call>{"name": "mul", "arguments": {"a": 6, "b": 7}}</tool_call>'
TOOLS = [{"type": "function", "name": "mul", "description": "multiply",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]


def assert_one_exact_trajectory(ep, llm) -> None:
    """Both calls on one branch: the second prompt extends the first's prompt + sampled ids exactly,
    and every sampled token is trained once."""
    assert len(ep.history.branches) == 1 and ep.history.forks == 0
    assert llm.prompts[1][:len(llm.prompts[0]) + len(llm.turns[0])] == llm.prompts[0] + llm.turns[0]
    traj = ep.history.last.trajectory(1.0)
    assert traj.prompt_ids.tolist() == llm.prompts[0] and traj.turns == 2
    assert np.concatenate([traj.prompt_ids, traj.response_ids]).tolist() == llm.prompts[1] + llm.turns[1]
    assert traj.response_ids[traj.loss_mask == 1].tolist() == llm.turns[0] + llm.turns[1]
    assert "<tool_response>\n42\n</tool_response>" in TOK.decode(traj.response_ids.tolist())


def second_input(first_input: list, r) -> list:
    """The next call's input: the first's, its output items echoed as the client dumps them, the tool's output."""
    call = next(o for o in r.output if o.type == "function_call")
    return first_input + [o.model_dump(exclude_none=True) for o in r.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "42"}]


async def test_a_tool_episode_over_responses_is_one_exact_trajectory():
    llm = ScriptedLLM(["Let me see." + CALL, "It is 42."])
    async with serving(llm) as (server, ep):
        c = client(server, ep)
        first = [{"role": "user", "content": "6*7?"}]
        r = await c.responses.create(model="policy", instructions="Be brief.", input=first, tools=TOOLS,
                                     temperature=0.3, max_output_tokens=64)
        Response.model_validate(r.model_dump(exclude_unset=True))  # every field OpenAI requires
        assert [o.type for o in r.output] == ["message", "function_call"] and r.status == "completed"
        assert r.output[0].content[0].text == "Let me see."
        call = r.output[1]
        assert call.name == "mul" and json.loads(call.arguments) == {"a": 6, "b": 7} and call.call_id.startswith("call_")
        assert r.usage.input_tokens == len(llm.prompts[0]) and r.usage.output_tokens == len(llm.turns[0])
        r2 = await c.responses.create(model="policy", instructions="Be brief.", input=second_input(first, r),
                                      tools=TOOLS)
        assert r2.output_text == "It is 42." and [o.type for o in r2.output] == ["message"]
    assert "Be brief." in TOK.decode(llm.prompts[0]) and '"name": "mul"' in TOK.decode(llm.prompts[0])
    assert_one_exact_trajectory(ep, llm)


def test_the_sync_client_a_text_input_and_a_cut_answer():
    async def main():
        llm = ScriptedLLM([CALL, "It is 42.", "one two three four five six"])
        async with serving(llm) as (server, ep):
            c = client(server, ep, sync=True)
            first = [{"role": "user", "content": "6*7?"}]
            r = await asyncio.to_thread(c.responses.create, model="policy", input=first, tools=TOOLS)
            assert [o.type for o in r.output] == ["function_call"]  # no text before the call: no message item
            r2 = await asyncio.to_thread(c.responses.create, model="policy", input=second_input(first, r), tools=TOOLS)
            assert r2.output_text == "It is 42."
            assert_one_exact_trajectory(ep, llm)
            cut = await asyncio.to_thread(c.responses.create, model="policy", input="count", max_output_tokens=3)
            assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
            assert cut.usage.output_tokens == 3 and llm.prompts[2] == RENDERER.prompt_ids(
                [{"role": "user", "content": "count"}], ())  # a text input is one user message

    asyncio.run(main())


async def test_streaming_gives_responses_events():
    llm = ScriptedLLM(["Let me." + CALL])
    async with serving(llm) as (server, ep):
        stream = await client(server, ep).responses.create(model="policy", input="6*7?", tools=TOOLS, stream=True)
        events = [e async for e in stream]
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e.model_dump(exclude_unset=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert text == "Let me." and json.loads(args) == {"a": 6, "b": 7}
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["message", "function_call"] and events[-1].response.usage.output_tokens == len(llm.turns[0])


async def test_previous_response_id_continues_the_stored_conversation_on_one_branch():
    llm = ScriptedLLM(["Let me see." + CALL, "It is 42.", "Again."])
    async with serving(llm) as (server, ep):
        c = client(server, ep)
        r = await c.responses.create(model="policy", instructions="Be brief.", input="6*7?", tools=TOOLS)
        assert r.store is True
        call = r.output[1]
        r2 = await c.responses.create(model="policy", instructions="Be brief.", previous_response_id=r.id, tools=TOOLS,
                                      input=[{"type": "function_call_output", "call_id": call.call_id, "output": "42"}])
        assert r2.output_text == "It is 42." and r2.previous_response_id == r.id
        assert_one_exact_trajectory(ep, llm)
        unstored = await c.responses.create(model="policy", input="hi", store=False)
        with pytest.raises(openai.BadRequestError) as e:
            await c.responses.create(model="policy", input="more", previous_response_id=unstored.id)
        assert e.value.body["param"] == "previous_response_id" and len(llm.prompts) == 3


@pytest.mark.parametrize("kwargs, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"), ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"), ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"include": ["message.output_text.logprobs"]}, "include"), ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"), ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
])
async def test_each_refused_field_is_a_400_naming_it(kwargs, param):
    llm = ScriptedLLM()
    async with serving(llm) as (server, ep):
        with pytest.raises(openai.BadRequestError) as e:
            await client(server, ep).responses.create(model="p", **{"input": "hi", **kwargs})
    assert e.value.body["param"] == param and param.split("[")[0].split(".")[0] in e.value.message
    assert llm.prompts == [] and ep.calls == 0  # refused before it counted or reached the engine


async def test_a_wrong_key_is_401_and_a_long_input_names_input():
    from asyncrl.agent.endpoint import EpisodeLimits

    llm = ScriptedLLM()
    async with serving(llm, EpisodeLimits(max_context_tokens=50)) as (server, ep):
        with pytest.raises(openai.AuthenticationError):
            await client(server, ep, key="sk-wrong").responses.create(model="p", input="hi")
        with pytest.raises(openai.BadRequestError) as e:
            await client(server, ep).responses.create(model="p", input="y" * 300)
    assert e.value.body["param"] == "input" and e.value.body["code"] == "context_length_exceeded"
    assert llm.prompts == []

