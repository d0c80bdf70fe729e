"""EnvLoop over the built-in engine with a real tiny model: three turns with a @tool, token in,
token out.

The model is a tiny Qwen2 built from a config over a character-level ChatML tokenizer whose chat
template shows tools (`asyncrl.models.tiny_chat`), trained here for a few seconds to hold one
tool-using conversation: ask ``lookup`` for ``ab``, then for ``cd``, then answer ``AB CD``. Greedy
decoding then replays it, so every turn, observation and marker is known to the token.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from asyncrl.agent import (OBSERVATION_VERSION, EngineLLM, Env, EnvLoop, EnvLoopConfig, SingleTurnLoop, Step,
                           ToolEnv, tool)
from asyncrl.models.tiny_chat import build_chat_tokenizer
from asyncrl.rollouter import TorchEngine
from asyncrl.types import SamplingParams

GREEDY = SamplingParams(greedy=True)
QUESTION = "find ab, cd"


def _lookup(key: str) -> str:
    """Look up a key.

    Args:
        key: the key
    """
    return key.upper()


LOOKUP = tool(_lookup, name="lookup")


def call(key: str) -> str:
    return '<tool_call>{"name": "lookup", "arguments": {"key": "%s"}}</tool_call>' % key


CONVERSATION = [
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": call("ab")},
    {"role": "tool", "content": "AB"},
    {"role": "assistant", "content": call("cd")},
    {"role": "tool", "content": "CD"},
    {"role": "assistant", "content": "AB CD"},
]


def render(tok, messages, generation_prompt=False) -> list[int]:
    text = tok.apply_chat_template(messages, tools=[LOOKUP.schema], tokenize=False,
                                   add_generation_prompt=generation_prompt)
    return tok.encode(text, add_special_tokens=False)


def expected_ids_and_mask(tok) -> tuple[list[int], np.ndarray]:
    """The conversation as the template renders it (up to the last ``<|im_end|>``), and 1 exactly
    on each assistant message's content and its ``<|im_end|>``."""
    ids = render(tok, CONVERSATION)[:-1]  # the trajectory ends on the model's <|im_end|>, before "\n"
    mask = np.zeros(len(ids), np.uint8)
    for i, m in enumerate(CONVERSATION):
        if m["role"] == "assistant":
            start = len(render(tok, CONVERSATION[:i], generation_prompt=True))
            mask[start:start + len(tok.encode(m["content"], add_special_tokens=False)) + 1] = 1
    return ids, mask


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, tok):
    """The tiny model, trained on `CONVERSATION`'s assistant tokens until greedy replays it
    (about 550 Adam steps, ~10 s on one core). At lr 1e-2 the loss oscillated instead on some CPUs
    (seed 0 on an AVX-512 machine: 0.40 after 800 steps); 3e-3 comes down smoothly on every seed tried."""
    torch.set_num_threads(1)  # more threads than free cores makes this 30x slower on a shared machine
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    ids, mask = expected_ids_and_mask(tok)
    x = torch.tensor(ids)[None]
    w = torch.tensor(mask[1:], dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(1500):
        nll = torch.nn.functional.cross_entropy(model(x).logits[0, :-1], x[0, 1:], reduction="none")
        loss = (nll * w).sum() / w.sum()
        if loss.item() < 1e-3:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 1e-3, f"the tiny model did not learn the conversation (loss {loss.item():.4f})"
    path = tmp_path_factory.mktemp("agent") / "m"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ref(model_path):
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture
async def engine(model_path):
    e = TorchEngine(model_path)
    yield e
    await e.close()


@torch.no_grad()
def recompute(ref, tr) -> np.ndarray:
    """Log-prob of every response token under a full forward of the whole trajectory."""
    ids = torch.as_tensor(np.concatenate([tr.prompt_ids, tr.response_ids]))[None]
    logp = torch.log_softmax(ref(ids).logits[0].float(), -1)
    p = len(tr.prompt_ids)
    return logp[p - 1:-1].gather(1, ids[0, p:, None])[:, 0].numpy()


def spans(mask: np.ndarray, value: int) -> list[tuple[int, int]]:
    """[start, stop) runs of ``value`` in ``mask``."""
    out, start = [], None
    for i, v in enumerate([*mask.tolist(), -1]):
        if v == value and start is None:
            start = i
        elif v != value and start is not None:
            out.append((start, i))
            start = None
    return out


def tool_loop(**limits) -> EnvLoop:
    cfg = EnvLoopConfig(**{"max_turns": 4, "max_tokens_per_turn": 80, "max_context_tokens": 1024, **limits})
    return EnvLoop(lambda: ToolEnv([LOOKUP]), build_chat_tokenizer(), cfg)


async def test_three_turns_token_in_token_out(engine, ref, tok):
    llm = EngineLLM(engine, GREEDY)
    tr = await tool_loop().run(QUESTION, llm)
    assert (tr.finish_reason, tr.turns, tr.tool_calls, tr.tool_errors) == ("stop", 3, 2, 0)
    assert tr.final_text == "AB CD" and tr.reward is None and llm.requests == 3
    ids, mask = expected_ids_and_mask(tok)
    # The prompt, the model's tokens and the appended markers are exactly what the template renders.
    np.testing.assert_array_equal(np.concatenate([tr.prompt_ids, tr.response_ids]), ids)
    np.testing.assert_array_equal(tr.loss_mask, mask[len(tr.prompt_ids):])
    model, obs = tr.loss_mask == 1, tr.loss_mask == 0
    np.testing.assert_allclose(tr.logprobs[model], recompute(ref, tr)[model], atol=1e-4, rtol=0)
    assert (tr.logprobs[obs] == 0).all() and (tr.versions[obs] == OBSERVATION_VERSION).all()
    assert (tr.versions[model] == 0).all()
    assert [tok.decode(tr.response_ids[a:b]) for a, b in spans(tr.loss_mask, 0)] == [
        f"\n<|im_start|>user\n<tool_response>\n{out}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        for out in ("AB", "CD")]


async def test_sampled_turns_keep_their_behaviour_logprobs(engine, ref, tok):
    tr = await tool_loop().run(QUESTION, EngineLLM(engine, SamplingParams(temperature=1.0, seed=7)))
    assert tr.turns >= 2
    model = tr.loss_mask == 1
    np.testing.assert_allclose(tr.logprobs[model], recompute(ref, tr)[model], atol=1e-4, rtol=0)
    for a, b in spans(tr.loss_mask, 0):  # every masked run is one observation with its markers
        text = tok.decode(tr.response_ids[a:b])
        assert text.startswith("\n<|im_start|>user\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert len(spans(tr.loss_mask, 1)) == tr.turns


def _failing(kind: str):
    import asyncio
    import time

    def raises(key: str) -> str:
        raise ValueError(f"no such key {key}")

    def sleeps(key: str) -> str:
        time.sleep(1.0)
        return key

    async def sleeps_async(key: str) -> str:
        await asyncio.sleep(30)
        return key

    def gives_bytes(key: str) -> str:
        return key.encode()

    fn = {"raises": raises, "sleeps": sleeps, "sleeps_async": sleeps_async, "bytes": gives_bytes}[kind]
    fn.__doc__ = _lookup.__doc__
    return tool(fn, name="lookup")


@pytest.mark.parametrize("kind, error", [
    ("raises", "Error: tool 'lookup' raised ValueError: no such key ab"),
    ("sleeps", "Error: tool 'lookup' timed out after 0.2 s (tool_timeout_s)"),
    ("sleeps_async", "Error: tool 'lookup' timed out after 0.2 s (tool_timeout_s)"),
    ("bytes", "Error: tool 'lookup' returned bytes; a tool must return text (str) or a JSON value"),
])
async def test_failing_tool_is_an_observation_and_the_conversation_goes_on(engine, tok, kind, error):
    loop = EnvLoop(lambda: ToolEnv([_failing(kind)], tool_timeout_s=0.2), tok,
                   EnvLoopConfig(max_turns=3, max_tokens_per_turn=80, max_context_tokens=1024))
    tr = await loop.run(QUESTION, EngineLLM(engine, GREEDY))
    first_obs = spans(tr.loss_mask, 0)[0]
    assert f"<tool_response>\n{error}\n</tool_response>" in tok.decode(tr.response_ids[slice(*first_obs)])
    assert tr.turns >= 2 and tr.tool_errors >= 1  # the model wrote another turn after the error
    assert tr.loss_mask[-1] == 1


async def test_max_turns(engine, tok):
    tr = await tool_loop(max_turns=2).run(QUESTION, EngineLLM(engine, GREEDY))
    ids, mask = expected_ids_and_mask(tok)
    assert (tr.finish_reason, tr.turns, tr.tool_calls) == ("max_turns", 2, 2)  # step ran on the last turn
    # It ends on the second turn's <|im_end|>: the last observation is not appended.
    end = len(tr.prompt_ids) + len(tr.response_ids)
    np.testing.assert_array_equal(np.concatenate([tr.prompt_ids, tr.response_ids]), ids[:end])
    assert tok.decode(tr.response_ids[-1:]) == "<|im_end|>" and tr.loss_mask[-1] == 1


async def test_context_limit(engine, tok):
    prompt_len = len(render(tok, CONVERSATION[:1], generation_prompt=True))
    first_turn = len(tok.encode(call("ab"), add_special_tokens=False)) + 1
    # The first observation does not fit: the episode ends after turn 1, nothing masked appended.
    tr = await tool_loop(max_context_tokens=prompt_len + first_turn + 10).run(QUESTION, EngineLLM(engine, GREEDY))
    assert (tr.finish_reason, tr.turns, len(tr.response_ids)) == ("context", 1, first_turn)
    assert tr.loss_mask.all()
    # The context cuts the first turn itself short.
    tr = await tool_loop(max_context_tokens=prompt_len + 12).run(QUESTION, EngineLLM(engine, GREEDY))
    assert (tr.finish_reason, tr.turns, len(tr.response_ids)) == ("context", 1, 12)
    # A turn that uses its own budget is "length".
    tr = await tool_loop(max_tokens_per_turn=12).run(QUESTION, EngineLLM(engine, GREEDY))
    assert (tr.finish_reason, len(tr.response_ids)) == ("length", 12)


class Scripted(Env):
    """A user's env (no ToolEnv): answers the first turn as the tool would, with a reward per step."""

    tools = (LOOKUP.schema,)

    def __init__(self):
        self.seen: list[str] = []
        self.closed = False

    async def reset(self, prompt):
        return [{"role": "user", "content": prompt}]

    async def step(self, text):
        self.seen.append(text)
        if len(self.seen) == 1:
            return Step([{"role": "tool", "content": "AB"}], reward=0.25)
        return Step(None, reward=1.0, done=True)

    async def close(self):
        self.closed = True


async def test_a_user_env_and_its_last_reward(engine, ref, tok):
    envs = []
    loop = EnvLoop(lambda: envs.append(Scripted()) or envs[-1], tok, EnvLoopConfig(max_tokens_per_turn=80))
    tr = await loop.run(QUESTION, EngineLLM(engine, GREEDY))
    (env,) = envs
    assert env.closed and env.seen == [call("ab"), call("cd")]
    assert (tr.finish_reason, tr.turns, tr.reward, tr.tool_calls) == ("stop", 2, 1.0, 0)
    model = tr.loss_mask == 1
    np.testing.assert_allclose(tr.logprobs[model], recompute(ref, tr)[model], atol=1e-4, rtol=0)


def test_text_observation_is_a_user_turn(tok):
    from asyncrl.agent import ChatRenderer

    r = ChatRenderer(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert r.stop_ids == (im_end,)
    after_stop = tok.decode(r.observation_ids([5, im_end], "say more"))
    assert after_stop == "\n<|im_start|>user\nsay more<|im_end|>\n<|im_start|>assistant\n"
    # A turn that ended on another token (e.g. EOS) gets the whole closing marker first.
    eos = tok.eos_token_id
    assert tok.decode(r.observation_ids([5, eos], "x")) == "<|im_end|>\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    assert r.turn_text(tok.encode("hi<|im_end|>", add_special_tokens=False)) == "hi"


async def test_an_env_that_raises_fails_the_episode_and_is_closed(engine, tok):
    class Broken(Scripted):
        async def step(self, text):
            raise RuntimeError("env exploded")

    envs = []
    loop = EnvLoop(lambda: envs.append(Broken()) or envs[-1], tok)
    with pytest.raises(RuntimeError, match="env exploded"):
        await loop.run(QUESTION, EngineLLM(engine, GREEDY))
    assert envs[0].closed


async def test_single_turn_generation_is_the_trivial_loop(engine, ref, tok):
    prompt = np.asarray(render(tok, CONVERSATION[:1], generation_prompt=True))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    tr = await SingleTurnLoop(max_tokens=80, stop=(im_end,)).run(prompt, EngineLLM(engine, GREEDY))
    assert (tr.finish_reason, tr.turns) == ("stop", 1) and tr.loss_mask.all()
    assert tok.decode(tr.response_ids) == call("ab") + "<|im_end|>"
    np.testing.assert_allclose(tr.logprobs, recompute(ref, tr), atol=1e-4, rtol=0)


def _rendered_in_full(r, tok, turn_ids, observation):
    """What `observation_ids` gave before its caches: the template rendered around the observation."""
    from asyncrl.agent.render import as_messages

    full = r._render(r._base() + as_messages(observation))
    closing = r._closing
    if turn_ids[-1] in r._stop_text:
        closing = closing[len(r._stop_text[turn_ids[-1]]):]
    return tok.encode(closing + full[len(r._head):], add_special_tokens=False)


@pytest.mark.parametrize("observation", [
    "say more", "  leading and trailing spaces  ", "braces {x} and %s and\nnew\tlines",
    [{"role": "tool", "content": '{"result": 42}'}], [{"role": "tool", "name": "lookup", "content": " 7 "}],
    [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}],  # two messages: rendered in full
])
def test_cached_observation_markers_give_the_templates_own_tokens(tok, observation):
    from asyncrl.agent import ChatRenderer

    r = ChatRenderer(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for turn in ([5, im_end], [5, tok.eos_token_id]):
        first = r.observation_ids(turn, observation)
        assert first == r.observation_ids(turn, observation) == _rendered_in_full(r, tok, turn, observation)
    one = observation if isinstance(observation, list) else [{"role": "user"}]
    # ChatML inserts a text verbatim: a one-message observation is served from its shape's markers
    assert any(w is not None for w in r._wrap.values()) == (len(one) == 1)


def test_a_template_that_rewrites_the_text_is_rendered_every_time(tok):
    """A template that trims what it shows is not cached for that role: its tokens stay exact."""
    from asyncrl.agent import ChatRenderer

    trimming = copy.deepcopy(tok)
    trimming.chat_template = tok.chat_template.replace("message.content", "(message.content | trim)")
    assert trimming.chat_template != tok.chat_template
    r = ChatRenderer(trimming)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = r.observation_ids([5, im_end], "  padded  ")
    assert list(r._wrap.values()) == [None]
    assert ids == _rendered_in_full(r, trimming, [5, im_end], "  padded  ")
    assert "  padded" not in trimming.decode(ids) and "padded" in trimming.decode(ids)


def test_the_opening_of_a_group_is_rendered_once_and_given_as_a_copy(tok, monkeypatch):
    from asyncrl.agent import ChatRenderer

    r = ChatRenderer(tok)
    calls = []
    render = r._render
    monkeypatch.setattr(r, "_render", lambda *a, **k: calls.append(a) or render(*a, **k))
    first = r.prompt_ids("what is 6 x 7?")
    first.append(-1)  # the caller's list is its own
    again = r.prompt_ids([{"role": "user", "content": "what is 6 x 7?"}])
    assert len(calls) == 1 and again == tok.encode(render([{"role": "user", "content": "what is 6 x 7?"}]),
                                                   add_special_tokens=False)
    r.prompt_ids("another prompt")
    assert len(calls) == 2
