"""The records every part of asyncrl shares.

A prompt fed by the Rollouter is one `sample_id` = ``sample_{epoch}_{index}``; it is answered
``n`` times. Each answer is a `Trajectory`; the ``n`` answers travel together as a `Group`.
The sample stream carries groups, and only complete (or failed) ones: the Trainer never sees
half a group.

Token arrays are numpy arrays (or torch tensors), never Python lists, so they cross the
stream as raw frames.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Iterator, Set
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

FinishReason = Literal["stop", "length", "abort", "truncated"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "truncated")
GroupStatus = Literal["ok", "failed"]

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


def _split_sample_id(sample_id: str) -> tuple[int, int] | None:
    """``(epoch, index)`` of a well-formed sample_id, else None (cheaper than the regex)."""
    head, sep, index = sample_id.rpartition("_")
    epoch = head[7:]
    if not sep or not head.startswith("sample_") or not _canonical_int(index) or not _canonical_int(epoch):
        return None
    return int(epoch), int(index)


def _canonical_int(text: str) -> bool:
    # What make_sample_id writes: ASCII digits, no leading zero.
    return text.isdigit() and text.isascii() and (text == "0" or text[0] != "0")


class CommittedSet(Set):
    """The ``sample_id``s a run is done with (trained or dropped), kept small however long the run.

    The feed index of ``sample_{epoch}_{index}`` never restarts, so the done ids are stored as
    a *watermark* (every index below it is done), the epoch each stretch below it belongs to
    (one entry per epoch), and the *exceptions*: done ids above the watermark. Groups finish a
    little out of feed order, so the exceptions stay as few as the ids in flight (the
    staleness budget), not as many as the run has trained. Ids not of the
    ``sample_{epoch}_{index}`` form are kept as they are.

    A ``collections.abc.Set`` of str (``in``, ``len``, iteration, ``==`` and ``|`` with sets).
    In one feed an index is one sample; ids that share an index with a done id of another epoch
    (several producers numbering their own feeds, hand-made ids) are kept one by one, so the set
    stays exact whatever ids it is given.
    """

    def __init__(self, ids: Iterable[str] = ()):
        self._watermark = 0
        self._epochs: list[tuple[int, int]] = []  # (first index, epoch) of each stretch below the watermark
        self._above: dict[int, int] = {}  # index -> epoch, for done indices >= watermark
        self._other: set[str] = set()
        if isinstance(ids, CommittedSet):
            self._watermark, self._epochs = ids._watermark, list(ids._epochs)
            self._above, self._other = dict(ids._above), set(ids._other)
        else:
            self.update(ids)

    @classmethod
    def _from_iterable(cls, it: Iterable[str]) -> CommittedSet:
        return cls(it)

    @property
    def watermark(self) -> int:
        """Every feed index below this is done."""
        return self._watermark

    @property
    def exceptions(self) -> int:
        """How many done ids are kept one by one (above the watermark, or not feed ids)."""
        return len(self._above) + len(self._other)

    def max_index(self) -> int:
        """The highest done feed index, -1 when none is done."""
        return max(self._above, default=self._watermark - 1)

    def missing(self, stop: int) -> list[int]:
        """Feed indices below ``stop`` that are not done, in order (the pending ones of a feed at ``stop``)."""
        return [i for i in range(self._watermark, stop) if i not in self._above]

    def copy(self) -> CommittedSet:
        return CommittedSet(self)

    def _epoch_below(self, index: int) -> int:
        return self._epochs[bisect.bisect_right(self._epochs, (index, float("inf"))) - 1][1]

    def __contains__(self, sample_id: Any) -> bool:
        if not isinstance(sample_id, str):
            return False
        parsed = _split_sample_id(sample_id)
        if parsed is None:
            return sample_id in self._other
        epoch, index = parsed
        if index < self._watermark:
            return self._epoch_below(index) == epoch or sample_id in self._other
        return self._above.get(index) == epoch or sample_id in self._other

    def __len__(self) -> int:
        return self._watermark + len(self._above) + len(self._other)

    def __iter__(self) -> Iterator[str]:
        bounds = [start for start, _ in self._epochs[1:]] + [self._watermark]
        for (start, epoch), stop in zip(self._epochs, bounds):
            for index in range(start, stop):
                yield f"sample_{epoch}_{index}"
        for index in sorted(self._above):
            yield f"sample_{self._above[index]}_{index}"
        yield from sorted(self._other)

    def __repr__(self) -> str:
        return f"CommittedSet(watermark={self._watermark}, exceptions={self.exceptions})"

    def add(self, sample_id: str) -> None:
        """Mark ``sample_id`` done (an index already done under another epoch: kept one by one)."""
        parsed = _split_sample_id(sample_id)
        if parsed is None:
            self._other.add(sample_id)
            return
        epoch, index = parsed
        known = self._epoch_below(index) if index < self._watermark else self._above.get(index, epoch)
        if known != epoch:
            self._other.add(sample_id)
            return
        if index < self._watermark:
            return
        self._above[index] = epoch
        while self._watermark in self._above:  # amortised O(1): each index passes the watermark once
            e = self._above.pop(self._watermark)
            if not self._epochs or self._epochs[-1][1] != e:
                self._epochs.append((self._watermark, e))
            self._watermark += 1

    def update(self, ids: Iterable[str]) -> None:
        for sid in ids:
            self.add(sid)

    def to_json(self) -> dict:
        """``{"watermark", "epochs": [[first_index, epoch], ...], "exceptions": [sample_id, ...]}``."""
        above = [f"sample_{self._above[i]}_{i}" for i in sorted(self._above)]
        return {"watermark": self._watermark, "epochs": [list(e) for e in self._epochs],
                "exceptions": above + sorted(self._other)}

    @classmethod
    def from_json(cls, data: dict | list) -> CommittedSet:
        """Inverse of `to_json`; a plain list of sample_ids (older sidecars) is accepted too."""
        if isinstance(data, list):
            return cls(data)
        try:
            out = cls()
            out._watermark = int(data["watermark"])
            out._epochs = [(int(start), int(epoch)) for start, epoch in data["epochs"]]
            if out._watermark and (not out._epochs or out._epochs[0][0] != 0):
                raise ValueError("the first epoch stretch must start at index 0")
            out.update(data["exceptions"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed committed set ({type(e).__name__}: {e}): "
                             "expected {watermark, epochs, exceptions}") from None
        return out


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
    return arr.astype(dtype, copy=False)


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
    """``stop`` | ``length`` | ``abort`` | ``truncated``."""
    reward: float = 0.0
    """Scalar reward; set by the Rollouter's reward function."""
    age: int = 0
    """Truncation rounds this response survived (partial rollout)."""

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

    @classmethod
    def _from_typed(cls, sample_id, index, prompt_ids, response_ids, logprobs, versions, finish_reason, reward, age):
        """Private fast path for the stream codec: the arrays are already 1-d int64/float32/int64
        with matching lengths (the codec checked them), so only ``finish_reason`` is checked."""
        if finish_reason not in FINISH_REASONS:
            raise ValueError(f"{sample_id}[{index}]: finish_reason {finish_reason!r} is not one of {FINISH_REASONS}")
        t = object.__new__(cls)
        t.sample_id, t.index, t.finish_reason, t.reward, t.age = sample_id, index, finish_reason, reward, age
        t.prompt_ids, t.response_ids, t.logprobs, t.versions = prompt_ids, response_ids, logprobs, versions
        return t

    @property
    def valid(self) -> bool:
        """A trajectory the Trainer may learn from: finished by the model, not cut off mid-flight."""
        return self.finish_reason in ("stop", "length")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trajectory):
            return NotImplemented
        return (
            self.sample_id == other.sample_id
            and self.index == other.index
            and self.finish_reason == other.finish_reason
            and self.reward == other.reward
            and self.age == other.age
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
