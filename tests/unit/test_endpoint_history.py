"""Property: over generated multi-turn conversations with tools on a ChatML template, each call's
prompt ids start with the previous call's prompt + the ids it sampled (the echoed assistant
message, however the client re-serializes it, maps to those ids), and the episode is one
trajectory training every sampled token exactly once."""

from __future__ import annotations

import asyncio
import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.agent.endpoint.episode import Episode, EpisodeLimits
from tests.unit.endpoint_helpers import RENDERER, TOOLS, ScriptedLLM

TEXT = st.text(alphabet="abcdefghij 0123456789.,!?\n{}\"", min_size=0, max_size=12)
CALL = st.fixed_dictionaries({"a": st.integers(-99, 999), "b": st.integers(0, 9)})
TURN = st.one_of(
    st.tuples(st.just("text"), TEXT.filter(lambda t: t.strip())),
    st.tuples(st.just("calls"), st.tuples(TEXT, st.lists(CALL, min_size=1, max_size=2))),
)
ECHO = st.sampled_from(["as_is", "null_content", "parts", "respaced", "new_ids", "no_type"])


def scripted_text(turn) -> str:
    kind, value = turn
    if kind == "text":
        return value
    head, calls = value
    return head + "".join('<tool_call>{"name": "mul", "arguments": ' + json.dumps(c) + "}</tool_call>" for c in calls)


def echo_of(message: dict, how: str) -> dict:
    m = json.loads(json.dumps(message))  # what came over the wire
    if how == "null_content" and not m.get("tool_calls"):
        return m
    if how == "null_content":
        m["content"] = "" if m.get("content") is None else m["content"]
    elif how == "parts":
        m["content"] = [{"type": "text", "text": m.get("content") or ""}]
    elif how == "respaced":
        for c in m.get("tool_calls") or ():
            c["function"]["arguments"] = json.dumps(json.loads(c["function"]["arguments"]), indent=1, sort_keys=True)
    elif how == "new_ids":
        for i, c in enumerate(m.get("tool_calls") or ()):
            c["id"] = f"client-{i}"
    elif how == "no_type":
        for c in m.get("tool_calls") or ():
            c.pop("type", None)
    return m


async def converse(turns, echoes, user_texts, with_system: bool):
    llm = ScriptedLLM([scripted_text(t) for t in turns])
    ep = Episode("prop", llm, RENDERER, EpisodeLimits(max_calls=64, max_context_tokens=100_000), "policy")
    msgs = ([{"role": "system", "content": "Be brief."}] if with_system else []) + [{"role": "user", "content": "start"}]
    for i, _ in enumerate(turns):
        body = await ep.chat({"model": "policy", "messages": msgs, "tools": TOOLS, "temperature": 0.3})
        message = body["choices"][0]["message"]
        msgs.append(echo_of(message, echoes[i % len(echoes)]))
        if message.get("tool_calls"):
            msgs += [{"role": "tool", "tool_call_id": c["id"], "content": str(k * 7)}
                     for k, c in enumerate(message["tool_calls"])]
        else:
            msgs.append({"role": "user", "content": user_texts[i % len(user_texts)] or "more"})
    return llm, ep


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=st.lists(TURN, min_size=1, max_size=5), echoes=st.lists(ECHO, min_size=1, max_size=5),
       user_texts=st.lists(TEXT, min_size=1, max_size=3), with_system=st.booleans())
def test_each_call_extends_the_previous_calls_exact_ids(turns, echoes, user_texts, with_system):
    llm, ep = asyncio.run(converse(turns, echoes, user_texts, with_system))
    for k in range(1, len(llm.prompts)):
        before = llm.prompts[k - 1] + llm.turns[k - 1]
        assert llm.prompts[k][:len(before)] == before
    assert ep.history.forks == 0 and len(ep.history.branches) == 1
    traj = ep.history.last.trajectory(1.0)
    assert np.concatenate([traj.prompt_ids, traj.response_ids]).tolist() == llm.prompts[-1] + llm.turns[-1]
    assert traj.response_ids[traj.loss_mask == 1].tolist() == [i for t in llm.turns for i in t]
    assert traj.turns == len(turns)
