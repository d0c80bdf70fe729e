"""Token-exact histories of one episode: each call's messages are placed on a recorded branch.

An OpenAI client sends the whole conversation on every call. Re-tokenizing it would train on
tokens the policy never sampled (a template that re-renders a past turn differently, a client
that re-serializes an assistant message), so instead:

- every branch keeps the exact ids the engine saw and sampled, and the messages they stand for;
- a call whose messages start with a branch's messages (an echoed assistant message compared by
  meaning: content text with ``null`` = ``""`` and outer whitespace ignored, tool calls by name
  and *parsed* arguments, their ids ignored) extends that branch: only the new messages are
  rendered (`ChatRenderer.observation_ids`, the template's bridging after a model turn) and
  appended, ``loss_mask`` 0; the sampled turn follows, ``loss_mask`` 1;
- any other call (an edited or compacted history, different tools, a second call on a branch
  that has one in flight) starts a new branch rendered from its messages: a fork. A fork never
  re-tokenizes into an existing branch; its first differing message is reported.

Nothing is recorded until a call's turn is sampled: a call that fails or is abandoned leaves the
episode as it was.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.agent.base import OBSERVATION_VERSION, AgentTrajectory, Message, Turn


def content_text(content: Any) -> str:
    """A message's content as text: None is ``""``; a list of parts is their texts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments as one canonical JSON text (a JSON string is parsed first)."""
    if isinstance(arguments, str):
        return _canonical_text(arguments)
    return json.dumps(arguments, sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=16384)
def _canonical_text(arguments: str) -> str:
    """`canonical_arguments` of a JSON text, remembered: every call of an episode sends its earlier
    assistant messages again, whose arguments would otherwise be parsed and re-serialized each time."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    except json.JSONDecodeError:
        return arguments.strip()


def message_key(m: Message) -> tuple:
    """What must agree for a message to count as the same one (see the module docstring)."""
    role = m.get("role")
    if role == "assistant":
        calls = tuple((c.get("function", c).get("name"), canonical_arguments(c.get("function", c).get("arguments")))
                      for c in m.get("tool_calls") or ())
        return ("assistant", content_text(m.get("content")).strip(), calls)
    return (role, content_text(m.get("content")), m.get("name"))


def template_message(m: Message, sampled: Sampled | None) -> Message:
    """``m`` as the chat template takes it: a sampled turn as the text the model wrote, content as
    text, tool-call arguments as objects (HF templates serialize them themselves)."""
    if sampled is not None:
        return {"role": "assistant", "content": sampled.text}
    out = {k: v for k, v in m.items() if k in ("role", "name")}  # (a per-call id would defeat the renderer's caches)
    if out.get("role") == "developer":  # OpenAI's newer name for the system role, which templates know
        out["role"] = "system"
    out["content"] = content_text(m.get("content"))
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            f = c.get("function", c)
            args = f.get("arguments")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                pass
            calls.append({"type": "function", "function": {"name": f.get("name"), "arguments": args}})
        out["tool_calls"] = calls
    return out


@dataclass(slots=True)
class Sampled:
    """An assistant message the engine wrote, as the endpoint returned it."""

    text: str
    """The turn's decoded text, end-of-turn marker stripped (what the model wrote)."""
    message: Message
    """The message returned to the client (content and ``tool_calls``)."""
    key: tuple = ()

    def __post_init__(self) -> None:
        self.key = message_key(self.message)


@dataclass(slots=True)
class Branch:
    """One token-exact conversation of the episode: a trajectory."""

    tools: Any
    """The ``tools`` of the call that opened the branch (a list; a route's name for ``completions``):
    a later call extends the branch only with equal tools (``==``: the order of keys inside a
    schema does not matter, as before with sorted JSON; the branch keeps its first rendering)."""
    prompt_ids: np.ndarray
    keys: list[tuple] = field(default_factory=list)
    """`message_key` of each message the ids stand for, the sampled turns included."""
    sampled: list[Sampled | None] = field(default_factory=list)
    """Per message: the `Sampled` turn it is, or None (a message the client sent)."""
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    """(ids, loss_mask, logprobs, versions) appended after the prompt, in order."""
    length: int = 0
    """Prompt + response tokens."""
    busy: bool = False
    """A call on this branch is in flight (a second one forks instead of racing it)."""
    calls: int = 0
    last_turn: tuple[int, ...] = ()
    """The last sampled turn's ids (a tuple of ints: the collector stops tracking it, no list to walk)."""
    finish: str = "stop"

    ids: np.ndarray | None = None
    """The prompt and every part's ids joined, as of the last `History.commit` (None: no turn yet)."""

    def context(self) -> np.ndarray:
        return self.prompt_ids if self.ids is None else self.ids

    def trajectory(self, reward: float | None) -> AgentTrajectory:
        def joined(i: int, dtype) -> np.ndarray:
            return np.concatenate([p[i] for p in self.parts]).astype(dtype, copy=False) if self.parts else np.zeros(0, dtype)

        final = next((s.text for s in reversed(self.sampled) if s is not None), "")
        return AgentTrajectory(prompt_ids=self.prompt_ids, response_ids=joined(0, np.int64), loss_mask=joined(1, np.uint8),
                               logprobs=joined(2, np.float32), versions=joined(3, np.int64),
                               finish_reason="length" if self.finish == "length" else "stop", reward=reward,
                               turns=self.calls, final_text=final)


@dataclass(slots=True)
class Placement:
    """Where a call goes: the ids to send, and what to record once its turn is sampled."""

    branch: Branch
    """The branch it extends, or a new one (not yet in the episode: `History.commit` adds it)."""
    new: bool
    context: np.ndarray
    """The ids the engine continues."""
    bridge: list[int]
    """Ids appended before the turn (the rendered new messages), ``loss_mask`` 0."""
    keys: list[tuple]
    fork_of: tuple[int, Message | None] | None = None
    """A fork's (index of its first differing message, that message) against the nearest branch."""


class History:
    """The branches of one episode, and the rule placing each call (the module docstring)."""

    def __init__(self, renderer: Any):
        self.renderer = renderer
        self.branches: list[Branch] = []
        self.forks = 0
        self.divergences: list[tuple[int, Message | None]] = []
        """Per fork: the index of its first message that differs from every branch, and that message."""
        self.last: Branch | None = None
        """The branch of the last call that finished (the episode's main branch, its first trajectory)."""

    def place(self, messages: list[Message], tools: list | None) -> Placement:
        """The branch ``messages`` extend (marked busy), else a new one rendered from them."""
        tools = tools or []  # (compared with ``==``, not as JSON: this runs on every call)
        keys = [message_key(m) for m in messages]
        for b in self.branches:
            n = len(b.keys)
            if (b.tools == tools and not b.busy and len(keys) > n and keys[:n] == b.keys
                    and b.sampled and b.sampled[-1] is not None):
                bridge = self.renderer.observation_ids(b.last_turn, [template_message(m, None) for m in messages[n:]])
                b.busy = True
                return Placement(b, False, np.concatenate([b.context(), np.asarray(bridge, np.int64)]), bridge, keys)
        by_key = {s.key: s for b in self.branches for s in b.sampled if s is not None}
        rendered = [template_message(m, by_key.get(k) if m.get("role") == "assistant" else None)
                    for m, k in zip(messages, keys)]
        prompt = np.asarray(self.renderer.prompt_ids(rendered, tools or ()), np.int64)
        branch = Branch(tools, prompt, busy=True)
        return Placement(branch, True, prompt, [], keys, self._divergence(keys, messages))

    def _divergence(self, keys: list[tuple], messages: list[Message]) -> tuple[int, Message | None] | None:
        """Against the branch sharing the longest prefix: the first differing message (None: the
        call's history is a prefix of it, or only the tools differ). None when nothing was recorded."""
        if not self.branches:
            return None
        best = 0
        for b in self.branches:
            n = 0
            while n < min(len(keys), len(b.keys)) and keys[n] == b.keys[n]:
                n += 1
            best = max(best, n)
        return best, messages[best] if best < len(messages) else None

    def commit(self, p: Placement, turn: Turn, sampled: Sampled) -> None:
        """Record a call's sampled turn on its branch (a new branch joins the episode)."""
        b = p.branch
        if p.new:
            if self.branches:
                self.forks += 1
                self.divergences.append(p.fork_of or (len(p.keys), None))
            self.branches.append(b)
        n_bridge = len(p.bridge)
        if n_bridge:
            b.parts.append((np.asarray(p.bridge, np.int64), np.zeros(n_bridge, np.uint8), np.zeros(n_bridge, np.float32),
                            np.full(n_bridge, OBSERVATION_VERSION, np.int64)))
        ids = np.asarray(turn.token_ids, np.int64)
        b.parts.append((ids, np.ones(len(ids), np.uint8), np.asarray(turn.logprobs, np.float32),
                        np.asarray(turn.versions, np.int64)))
        b.keys = p.keys + [sampled.key]
        b.sampled = b.sampled + [None] * (len(p.keys) - len(b.sampled)) + [sampled]
        b.ids = np.concatenate([p.context, ids])  # (``p.context``: the branch's ids and the bridge)
        b.length = len(b.ids)
        b.last_turn = tuple(ids.tolist())
        b.finish = turn.finish_reason
        b.calls += 1
        b.busy = False
        self.last = b

    def release(self, p: Placement) -> None:
        """A call that ended without a turn: its branch is free again, unchanged."""
        p.branch.busy = False
