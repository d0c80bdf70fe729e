"""Renderers: messages -> token ids for the prompt, and for each observation between turns.

Token in, token out: the conversation is never re-tokenized from its text. The prompt is
rendered once; after that only an observation is tokenized, with the chat template's markers
around it, and appended after the exact tokens the model sampled.

`ChatRenderer` finds those markers by rendering the template twice, once up to an assistant
message and once with the observation after it, and keeping the difference. For ChatML
(Qwen) after a turn that ended on ``<|im_end|>`` that is::

    \\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

(the closing ``\\n`` of the assistant message the model did not write, the observation, and the
next generation prompt). `PlainRenderer` serves envs with their own plain-text format.

Rendering runs on the Rollouter's event loop once per turn, so its costs are kept off the
template where that is exact: the markers around a one-message observation are rendered once
per message shape (role, tool name) and the text put between them (only for templates shown, at start, to insert a text
verbatim); an opening rendered for one prompt is kept for the next sample of its group; text is
encoded by the fast tokenizer's backend (checked at start to give the tokenizer's own ids), the
text between its added tokens once per distinct piece where that is exact (`SegmentEncoder`).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import numpy as np

from asyncrl.agent.base import Message
from asyncrl.agent.segments import SegmentEncoder

_SENTINEL = "\u2063asyncrl-turn\u2063"  # invisible separators: text no template rewrites
_SLOT = "\u2063asyncrl-text\u2063"
_PROBE = "  a {b} %s\n\tc  "  # whitespace at both ends, braces, a format mark: what a template could rewrite
_PROMPTS_KEPT = 256


def as_messages(observation: str | list[Message] | None) -> list[Message]:
    """An `Step.observation` as messages (a text is one ``user`` message)."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, list) and all(isinstance(m, dict) and "role" in m for m in observation):
        return observation
    raise TypeError(f"Step.observation must be a str, a list of messages (dicts with 'role') or None, "
                    f"got {type(observation).__name__}")


class ChatRenderer:
    """Renders with the tokenizer's chat template (see the module docstring)."""

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("ChatRenderer: the tokenizer has no chat_template (use PlainRenderer for a "
                             "plain-text env)")
        self.tokenizer = tokenizer
        base = self._base()
        head = self._render(base, add_generation_prompt=False)
        cut = head.rfind(_SENTINEL)
        if cut < 0:
            raise ValueError("ChatRenderer: the chat template drops the assistant message's content")
        self._head = head
        self._closing = head[cut + len(_SENTINEL):]
        """What closes an assistant turn after its text (ChatML: ``<|im_end|>\\n``)."""
        self.encode = self._pick_encoder()
        self._decode = self._pick_decoder()
        closing_ids = self.encode(self._closing)
        self.stop_ids: tuple[int, ...] = tuple(closing_ids[:1])
        """The end-of-turn token the model writes (first token of the closing)."""
        self._stop_text = {i: tokenizer.decode([i]) for i in self.stop_ids}
        self._wrap: dict[str, tuple[str, str] | None] = {}
        """Per message shape (its fields but the content, as JSON): the text before and after a
        one-message observation's content (None: the template does not insert it verbatim, so
        it is rendered each time)."""
        self._prompts: OrderedDict[str, np.ndarray] = OrderedDict()

    def _backend(self) -> Any:
        """The fast tokenizer's ``tokenizers.Tokenizer`` (None for a slow tokenizer)."""
        return getattr(self.tokenizer, "_tokenizer", None) if getattr(self.tokenizer, "is_fast", False) else None

    def _probe(self) -> str:
        """A text to check a shortcut against the tokenizer on: the template's own text, whitespace,
        braces, digits, and what a decode's clean-up rewrites (`` .``, `` 's``)."""
        return self._head + "\n" + _PROBE + " 12 + 30 = 42 . , ! ? n't 'm 's 've 're ' x"

    def _pick_encoder(self):
        """``text -> ids`` as ``tokenizer.encode(text, add_special_tokens=False)`` gives them: the
        fast tokenizer's backend directly (under half the wrapper's time per call) where it gives
        the same ids on the probe, else the tokenizer; the backend piece by piece between added
        tokens (`SegmentEncoder`) where that passes its own check on the probe too."""
        def slow(text: str) -> list[int]:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

        backend = self._backend()
        if backend is None or not hasattr(backend, "encode"):
            return slow

        def fast(text: str) -> list[int]:
            return backend.encode(text, add_special_tokens=False).ids

        probe = self._probe()
        if fast(probe) != slow(probe):
            return slow
        if not hasattr(backend, "get_added_tokens_decoder"):
            return fast
        pieces = SegmentEncoder(backend)
        pieces(probe)  # its first check against the whole text's ids: ``exact`` stays True only if they agree
        return pieces if pieces.exact else fast

    def _pick_decoder(self):
        """``ids -> text`` as ``tokenizer.decode(ids)``: the fast tokenizer's backend directly where it
        gives the same text on the probe's ids, else the tokenizer."""
        backend = self._backend()
        if backend is None or not hasattr(backend, "decode") or getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            return self.tokenizer.decode  # (that clean-up rewrites " ." and " 's" after the backend)
        probe = self.encode(self._probe())
        try:
            same = backend.decode(probe, skip_special_tokens=False) == self.tokenizer.decode(probe)
        except Exception:  # noqa: BLE001 - a backend that decodes otherwise: the tokenizer's own decode
            same = False
        if not same:
            return self.tokenizer.decode
        return lambda ids: backend.decode(ids, skip_special_tokens=False)

    @staticmethod
    def _base() -> list[Message]:
        return [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]

    def _render(self, messages: list[Message], tools=None, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, messages: str | list[Message], tools=()) -> list[int]:
        """The opening messages with the generation prompt, tools shown when given."""
        messages = as_messages(messages)
        try:
            key = json.dumps([messages, [getattr(t, "schema", t) for t in tools or ()]], sort_keys=True)
        except (TypeError, ValueError):  # not JSON (a user's own objects): rendered every time
            return self.encode(self._render(messages, tools))
        ids = self._prompts.get(key)
        if ids is None:
            # Kept as an array: the garbage collector never walks it (a list of a prompt's hundreds of
            # ids, made for each new conversation, was walked by every young collection it lived through).
            ids = self._prompts[key] = np.asarray(self.encode(self._render(messages, tools)), np.int64)
            if len(self._prompts) > _PROMPTS_KEPT:
                self._prompts.popitem(last=False)
        else:
            self._prompts.move_to_end(key)
        return ids.tolist()

    def _wrapping(self, message: Message) -> tuple[str, str] | None:
        """The text around ``message``'s content after an assistant turn, for messages like it
        (the same fields but the content: role, a tool's name...), once the template is seen to
        insert a probe text verbatim there (else None)."""
        fields = {k: v for k, v in message.items() if k != "content"}
        try:
            key = json.dumps(fields, sort_keys=True)
        except (TypeError, ValueError):
            return None
        if key not in self._wrap:
            wrap = None
            full = self._render(self._base() + [{**fields, "content": _SLOT}])
            if full.startswith(self._head) and full.count(_SLOT) == 1:
                before, after = full[len(self._head):].split(_SLOT)
                probe = self._render(self._base() + [{**fields, "content": _PROBE}])
                if probe == self._head + before + _PROBE + after:
                    wrap = (before, after)
            self._wrap[key] = wrap
        return self._wrap[key]

    def observation_ids(self, turn_ids: list[int], observation: str | list[Message] | None) -> list[int]:
        """Tokens to append after a model turn ``turn_ids``: the rest of the turn's closing, the
        observation's messages and the next generation prompt."""
        messages = as_messages(observation)
        wrap = None
        if len(messages) == 1 and isinstance(messages[0].get("content"), str):
            wrap = self._wrapping(messages[0])
        if wrap is not None:
            after_head = wrap[0] + messages[0]["content"] + wrap[1]
        else:
            full = self._render(self._base() + messages)
            if not full.startswith(self._head):
                raise ValueError("ChatRenderer: the chat template renders earlier messages differently once an "
                                 "observation follows; token-in-token-out needs an append-only template")
            after_head = full[len(self._head):]
        closing = self._closing
        if turn_ids and turn_ids[-1] in self._stop_text and closing.startswith(self._stop_text[turn_ids[-1]]):
            closing = closing[len(self._stop_text[turn_ids[-1]]):]
        return self.encode(closing + after_head)

    def turn_text(self, turn_ids: list[int]) -> str:
        """The model turn's text, its end-of-turn marker stripped."""
        if turn_ids and turn_ids[-1] in self._stop_text:
            turn_ids = turn_ids[:-1]
        return self._decode(turn_ids)


class PlainRenderer:
    """No chat template: the prompt and every observation are texts, tokenized as they are."""

    stop_ids: tuple[int, ...] = ()

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def _text(self, value: str | list[Message] | None, what: str) -> str:
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        raise TypeError(f"{what} must be a str for a plain-text env (no chat template), got {type(value).__name__}")

    def prompt_ids(self, messages: str | list[Message], tools=()) -> list[int]:
        return list(self.tokenizer.encode(self._text(messages, "Env.reset's result"), add_special_tokens=False))

    def observation_ids(self, turn_ids: list[int], observation: str | list[Message] | None) -> list[int]:
        return list(self.tokenizer.encode(self._text(observation, "Step.observation"), add_special_tokens=False))

    def turn_text(self, turn_ids: list[int]) -> str:
        return self.tokenizer.decode(turn_ids, skip_special_tokens=True)
