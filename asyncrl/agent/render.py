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
"""

from __future__ import annotations

from typing import Any

from asyncrl.agent.base import Message

_SENTINEL = "\u2063asyncrl-turn\u2063"  # invisible separators: text no template rewrites


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
        closing_ids = self.encode(self._closing)
        self.stop_ids: tuple[int, ...] = tuple(closing_ids[:1])
        """The end-of-turn token the model writes (first token of the closing)."""
        self._stop_text = {i: tokenizer.decode([i]) for i in self.stop_ids}

    @staticmethod
    def _base() -> list[Message]:
        return [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]

    def _render(self, messages: list[Message], tools=None, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: str | list[Message], tools=()) -> list[int]:
        """The opening messages with the generation prompt, tools shown when given."""
        return self.encode(self._render(as_messages(messages), tools))

    def observation_ids(self, turn_ids: list[int], observation: str | list[Message] | None) -> list[int]:
        """Tokens to append after a model turn ``turn_ids``: the rest of the turn's closing, the
        observation's messages and the next generation prompt."""
        full = self._render(self._base() + as_messages(observation))
        if not full.startswith(self._head):
            raise ValueError("ChatRenderer: the chat template renders earlier messages differently once an "
                             "observation follows; token-in-token-out needs an append-only template")
        closing = self._closing
        if turn_ids and turn_ids[-1] in self._stop_text and closing.startswith(self._stop_text[turn_ids[-1]]):
            closing = closing[len(self._stop_text[turn_ids[-1]]):]
        return self.encode(closing + full[len(self._head):])

    def turn_text(self, turn_ids: list[int]) -> str:
        """The model turn's text, its end-of-turn marker stripped."""
        if turn_ids and turn_ids[-1] in self._stop_text:
            turn_ids = turn_ids[:-1]
        return self.tokenizer.decode(turn_ids)


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
