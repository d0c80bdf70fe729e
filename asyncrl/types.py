"""The records every part of asyncrl shares.

A prompt fed by the Rollouter is one `sample_id` = ``sample_{epoch}_{index}``; it is answered
``n`` times. Each answer is a `Trajectory`; the ``n`` answers travel together as a `Group`.
The sample stream carries groups, and only complete (or failed) ones: the Trainer never sees
half a group.

Token arrays are numpy arrays (or torch tensors), never Python lists, so they cross the
stream as raw frames.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from asyncrl.committed import CommittedSet  # noqa: F401  (re-exported: asyncrl.types is its public home)

FinishReason = Literal["stop", "length", "abort", "truncated", "max_turns", "context"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "truncated", "max_turns", "context")
#: Finish reasons of a response the Trainer may learn from (an agent loop's turn or context
#: limit ends an episode like ``length`` ends a single turn); ``abort``/``truncated`` are cut off.
VALID_FINISH_REASONS: tuple[str, ...] = ("stop", "length", "max_turns", "context")
GroupStatus = Literal["ok", "failed"]
#: `Group.meta` key the Rollouter sets on a complete group its ``rollout.group_filter`` dropped
#: (the value names the filter): the Trainer trains none of it and records it as dropped, reason
#: ``filtered`` (`asyncrl.rollouter.filters`).
FILTERED_KEY = "group_filter_dropped"
#: `Group.meta` key of a group whose responses have several trajectories each, in varying number
#: (an endpoint agent's branches, ``rollout.agent.endpoint_branches=all``): a list holding, for each
#: trajectory index ``0..expected-1``, the response (episode) it belongs to. Advantages are taken
#: per episode (`episode_of`); without the key every trajectory is its own episode.
EPISODES_KEY = "episodes"

_SAMPLE_ID = re.compile(r"^sample_(\d+)_(\d+)$")


def make_sample_id(epoch: int, index: int) -> str:
    """``sample_{epoch}_{index}``; ``index`` is the Rollouter's monotonic feed order."""
    if epoch < 0 or index < 0:
        raise ValueError(f"sample_id needs non-negative epoch and index, got {epoch=}, {index=}")
    return f"sample_{epoch}_{index}"


def parse_sample_id(sample_id: str) -> tuple[int, int]:
    """Return ``(epoch, index)`` of ``sample_{epoch}_{index}``; ValueError names a bad id."""
    m = _SAMPLE_ID.match(sample_id)
    if m is None:
        raise ValueError(f"sample_id {sample_id!r} is not of the form 'sample_{{epoch}}_{{index}}'")
    return int(m.group(1)), int(m.group(2))


def _as_array(value, dtype, name: str) -> np.ndarray:
    # Accept torch tensors and numpy arrays; lists are refused so nothing slow reaches the wire.
    if isinstance(value, np.ndarray):
        arr = value
    elif type(value).__module__.startswith("torch"):
        arr = value.detach().cpu().numpy()
    else:
        raise TypeError(f"{name} must be a numpy array or torch tensor, got {type(value).__name__}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-d, got shape {arr.shape}")
    return arr if dtype is None else arr.astype(dtype, copy=False)


def _mask(value, n: int, who: str) -> np.ndarray:
    # A loss mask: one 0/1 per response token, stored as uint8 (bool or any 0/1 integers accepted).
    try:
        raw = _as_array(value, None, "loss_mask")
    except (TypeError, ValueError) as e:
        raise type(e)(f"{who}: {e}") from None
    if raw.dtype.kind not in "biu":
        raise TypeError(f"{who}: loss_mask must be bool or integer (0/1), got {raw.dtype}")
    if len(raw) != n:
        raise ValueError(f"{who}: loss_mask must have one entry per response token ({n}), got {len(raw)}")
    if len(raw) and (raw.min() < 0 or raw.max() > 1):
        raise ValueError(f"{who}: loss_mask must hold only 0 and 1, got values in [{raw.min()}, {raw.max()}]")
    return raw.astype(np.uint8, copy=False)


@dataclass(eq=False, slots=True)
class Trajectory:
    """One response to one prompt."""

    sample_id: str
    """The prompt's id, ``sample_{epoch}_{index}``."""
    index: int
    """Which of the group's ``n`` responses this is (0..n-1)."""
    prompt_ids: np.ndarray
    """Prompt token ids, int64."""
    response_ids: np.ndarray
    """Response token ids, int64."""
    logprobs: np.ndarray
    """Behaviour log-prob of each response token under the weights that sampled it, float32."""
    versions: np.ndarray
    """Policy version (number of weight syncs) that produced each response token, int64."""
    finish_reason: FinishReason
    """``stop`` | ``length`` | ``abort`` | ``truncated``; an agent loop's ``max_turns`` | ``context``."""
    reward: float = 0.0
    """Scalar reward; set by the Rollouter's reward function."""
    age: int = 0
    """Truncation rounds this response survived (partial rollout)."""
    loss_mask: np.ndarray | None = None
    """uint8 per response token: 1 on tokens the model wrote (trained), 0 on observation tokens
    (tool output, env replies, template markers between turns), which carry log-prob 0 and
    version -1. None: every token is the model's (a single-turn response; nothing on the wire)."""
    turns: int = 1
    """Model turns in the response (an agent loop's conversation; 1 for plain generation; 0 for
    an episode that ended before its first turn, e.g. on its context limit)."""

    def __post_init__(self) -> None:
        self.prompt_ids = _as_array(self.prompt_ids, np.int64, "prompt_ids")
        self.response_ids = _as_array(self.response_ids, np.int64, "response_ids")
        self.logprobs = _as_array(self.logprobs, np.float32, "logprobs")
        self.versions = _as_array(self.versions, np.int64, "versions")
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"{self.sample_id}[{self.index}]: response_ids, logprobs and versions must have one "
                f"entry per response token, got {n}, {len(self.logprobs)}, {len(self.versions)}"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"{self.sample_id}[{self.index}]: finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}"
            )
        if self.loss_mask is not None:
            self.loss_mask = _mask(self.loss_mask, n, f"{self.sample_id}[{self.index}]")
        if type(self.turns) is not int or self.turns < 0:
            raise ValueError(f"{self.sample_id}[{self.index}]: turns must be an int >= 0, got {self.turns!r}")

    @classmethod
    def _from_typed(cls, sample_id, index, prompt_ids, response_ids, logprobs, versions, finish_reason, reward, age,
                    loss_mask=None, turns=1):
        """Private fast path for the stream codec and the Rollouter's `Response` record: the arrays
        are already 1-d int64/float32/int64 (uint8 mask) with matching lengths (the caller checked
        them), so only ``finish_reason`` is checked."""
        if finish_reason not in FINISH_REASONS:
            raise ValueError(f"{sample_id}[{index}]: finish_reason {finish_reason!r} is not one of {FINISH_REASONS}")
        t = object.__new__(cls)
        t.sample_id, t.index, t.finish_reason, t.reward, t.age = sample_id, index, finish_reason, reward, age
        t.prompt_ids, t.response_ids, t.logprobs, t.versions = prompt_ids, response_ids, logprobs, versions
        t.loss_mask, t.turns = loss_mask, turns
        return t

    @property
    def valid(self) -> bool:
        """A trajectory the Trainer may learn from: finished by the model, not cut off mid-flight."""
        return self.finish_reason in VALID_FINISH_REASONS

    @property
    def model_tokens(self) -> int:
        """Response tokens the model wrote: those the loss sees."""
        return len(self.response_ids) if self.loss_mask is None else int(np.count_nonzero(self.loss_mask))

    @property
    def masked_tokens(self) -> int:
        """Response tokens the loss never sees (observations)."""
        return len(self.response_ids) - self.model_tokens

    @property
    def model_versions(self) -> np.ndarray:
        """The versions of the tokens the model wrote (observations' -1 left out): what staleness counts."""
        return self.versions if self.loss_mask is None else self.versions[self.loss_mask != 0]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        return (
            self.sample_id == other.sample_id
            and self.index == other.index
            and self.finish_reason == other.finish_reason
            and self.reward == other.reward
            and self.age == other.age
            and self.turns == other.turns
            and (self.loss_mask is None) == (other.loss_mask is None)
            and (self.loss_mask is None or np.array_equal(self.loss_mask, other.loss_mask))
            and all(
                np.array_equal(getattr(self, k), getattr(other, k))
                for k in ("prompt_ids", "response_ids", "logprobs", "versions")
            )
        )


@dataclass(eq=False, slots=True)
class Group:
    """The ``n`` responses of one ``sample_id``: what the sample stream carries."""

    sample_id: str
    trajectories: list[Trajectory]
    expected: int
    """How many responses the prompt asked for (``n``)."""
    status: GroupStatus = "ok"
    error: str | None = None
    """Why the group failed (set when ``status == "failed"``)."""
    meta: dict = field(default_factory=dict)
    """Plain values only (str, int, float, bool, None, lists/dicts of them): e.g. the prompt text."""

    def __post_init__(self) -> None:
        if self.expected < 1:
            raise ValueError(f"{self.sample_id}: expected must be >= 1, got {self.expected}")
        if self.status not in ("ok", "failed"):
            raise ValueError(f"{self.sample_id}: status {self.status!r} is not 'ok' or 'failed'")
        for t in self.trajectories:
            if t.sample_id != self.sample_id:
                raise ValueError(f"group {self.sample_id} holds a trajectory of {t.sample_id}")

    @classmethod
    def _from_typed(cls, sample_id, trajectories, expected, status, error, meta):
        """Private fast path for the stream codec: ``trajectories`` were built for ``sample_id``,
        so only ``expected`` and ``status`` are checked."""
        if type(expected) is not int or expected < 1:
            raise ValueError(f"{sample_id}: expected must be an int >= 1, got {expected!r}")
        if status not in ("ok", "failed"):
            raise ValueError(f"{sample_id}: status {status!r} is not 'ok' or 'failed'")
        g = object.__new__(cls)
        g.sample_id, g.trajectories, g.expected, g.status, g.error, g.meta = (
            sample_id, trajectories, expected, status, error, meta)
        return g

    @property
    def complete(self) -> bool:
        """True when the group may be trained on: ok, and ``expected`` valid, distinct responses."""
        return (
            self.status == "ok"
            and len(self.trajectories) == self.expected
            and len({t.index for t in self.trajectories}) == self.expected
            and all(t.valid for t in self.trajectories)
        )

    def missing(self) -> str:
        """Say what keeps this group from being complete ('' when it is complete)."""
        if self.status == "failed":
            return f"failed: {self.error or 'no error given'}"
        problems = []
        if len(self.trajectories) != self.expected:
            problems.append(f"{len(self.trajectories)} of {self.expected} trajectories")
        invalid = [f"{t.index}:{t.finish_reason}" for t in self.trajectories if not t.valid]
        if invalid:
            problems.append("unfinished responses " + ", ".join(invalid))
        if len({t.index for t in self.trajectories}) != len(self.trajectories):
            problems.append("duplicate response indices")
        return "; ".join(problems)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Group):
            return NotImplemented
        return (
            self.sample_id == other.sample_id
            and self.expected == other.expected
            and self.status == other.status
            and self.error == other.error
            and self.meta == other.meta
            and self.trajectories == other.trajectories
        )


def episode_of(group: Group) -> list[int]:
    """The episode of each of ``group``'s trajectories, in trajectory index order (`EPISODES_KEY`;
    without it, each trajectory is its own episode). ValueError when the key does not fit the group."""
    ts = sorted(group.trajectories, key=lambda t: t.index)
    episodes = group.meta.get(EPISODES_KEY)
    if episodes is None:
        return list(range(len(ts)))
    if (not isinstance(episodes, list) or len(episodes) != len(ts) or any(type(e) is not int for e in episodes)
            or [t.index for t in ts] != list(range(len(ts)))):
        raise ValueError(f"group {group.sample_id}: meta[{EPISODES_KEY!r}] must list one int episode per trajectory "
                         f"index 0..{len(ts) - 1}, got {str(episodes)[:200]} for indices {[t.index for t in ts][:20]}")
    return list(episodes)


@dataclass
class SamplingParams:
    """Sampling settings of one request, with vLLM's meanings."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    greedy: bool = False
    """Argmax decoding; logprobs are then those of temperature 1."""
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature <= 0 and not self.greedy:
            raise ValueError("temperature must be > 0; set greedy=True for argmax decoding")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")


@dataclass
class GenerateRequest:
    """One response to generate. For a resumed partial, ``prompt_ids`` = prompt + partial response."""

    request_id: str
    prompt_ids: np.ndarray
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    session_id: str | None = None
    """The conversation this request is a turn of (an agent loop's trajectory), or None. An engine
    may keep a finished turn's KV under it, so that the next turn of the same session, on the same
    weights, prefills only its new tokens; `RolloutEngine.end_session` lets it go."""

    def __post_init__(self) -> None:
        self.prompt_ids = _as_array(self.prompt_ids, np.int64, "prompt_ids")
        if len(self.prompt_ids) == 0:
            raise ValueError(f"request {self.request_id}: prompt_ids is empty")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class GenerateResult:
    """What an engine returns for one request."""

    request_id: str
    response_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    finish_reason: FinishReason
    prefill_tokens: int | None = None
    """Prompt tokens the engine computed for this request (a request that took a shared prompt's
    blocks: 0, or 1 when it fed the last prompt token itself); None when the engine does not say."""

    def __post_init__(self) -> None:
        self.response_ids = _as_array(self.response_ids, np.int64, "response_ids")
        self.logprobs = _as_array(self.logprobs, np.float32, "logprobs")
        self.versions = _as_array(self.versions, np.int64, "versions")
