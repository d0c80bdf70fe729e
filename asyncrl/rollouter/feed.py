"""The Rollouter's feed: which prompt goes next, and the position a checkpoint saves.

- ``sample_id`` is ``sample_{epoch}_{index}``; ``index`` is the feed order at admission, and it
  continues across epochs and across a resume (`RolloutState.next_index`).
- The feed walks the dataset's rows in order, epoch after epoch (`Feed.where`).
- Resume: a checkpoint stores the feed position; the ids admitted before it but not yet trained
  (in flight, or sent and not acked) are the feed indices below ``next_index`` that the
  Trainer's committed set lacks. A resumed feed serves them first, by id (`RolloutState.pending`,
  same ``sample_id`` and so the same sampling seeds), then new ids from ``next_index`` on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.rollouter.partial import PartialResponse
from asyncrl.types import CommittedSet, make_sample_id, parse_sample_id


@dataclass
class Prompt:
    """One dataset row, encoded."""

    text: str
    prompt_ids: np.ndarray
    meta: dict = field(default_factory=dict)
    max_tokens: int | None = None
    """This prompt's response budget; None takes `RolloutConfig.max_tokens`."""
    messages: list | None = None
    """The row's chat messages when it gave messages (what an endpoint agent gets as ``row["prompt"]``)."""

    def __post_init__(self) -> None:
        # int64 and 1-d from here on: a response's trajectory takes these ids as they are.
        ids = np.asarray(self.prompt_ids, dtype=np.int64)
        if ids.ndim != 1:
            raise ValueError(f"prompt {self.text[:40]!r}: prompt_ids must be 1-d, got shape {ids.shape}")
        self.prompt_ids = ids


@dataclass
class RolloutState:
    """Where the feed stands: what the Rollouter checkpoints and resumes from."""

    epoch: int = 0
    next_index: int = 0
    """Feed index of the next new prompt (never restarts)."""
    position: int = 0
    """Row of the current epoch to feed next."""
    pending: list[int] = field(default_factory=list)
    """Feed indices below ``next_index`` to generate (again) before any new one: admitted
    before a checkpoint and not trained by it (a resume fills this)."""
    done: int = 0
    """Groups already trained or dropped (before a resume): they count as admitted and sent."""
    dropped: int = 0
    """Of ``done``, how many were dropped: like failed groups they give their budget back."""
    partials: dict[str, dict[int, PartialResponse]] = field(default_factory=dict)
    """Truncated responses of pending samples saved by a checkpoint (``sample_id -> {k: parts}``):
    each continues from its parts instead of starting over."""

    @classmethod
    def resume(cls, saved: dict, committed: CommittedSet, dropped: int, rows: int) -> RolloutState:
        """Where a resumed Rollouter starts, from a checkpoint: its feed position ``saved`` (a
        `Rollouter.snapshot`), the Trainer's ``committed`` set and ``dropped`` count, over a
        dataset of ``rows`` prompts. Every feed index below ``next_index`` that is not committed
        was admitted and not trained: it becomes ``pending``. A feed position older than the
        committed set (saved before the Rollouter died) moves up past the highest committed id.
        """
        st = cls(epoch=int(saved.get("epoch", 0)), next_index=int(saved.get("next_index", 0)),
                 position=int(saved.get("position", 0)))
        top = committed.max_index() + 1
        if top > st.next_index:
            st.epoch, st.position = divmod(st.epoch * rows + st.position + top - st.next_index, rows)
            st.next_index = top
        st.pending = committed.missing(st.next_index)
        st.done, st.dropped = len(committed), dropped
        pending = set(st.pending)
        for sample_id, responses in saved.get("partials", {}).items():
            if parse_sample_id(sample_id)[1] in pending:  # a trained or dropped sample needs no parts
                st.partials[sample_id] = {int(k): PartialResponse.from_json(r) for k, r in responses.items()}
        return st


class Feed:
    """The prompts in feed order over a `RolloutState` (which it moves as it draws)."""

    def __init__(self, prompts: Sequence[Prompt], state: RolloutState):
        if not prompts:
            raise ValueError("Rollouter needs a non-empty dataset")
        self.prompts = list(prompts)
        self.state = state
        self.where(state.next_index)  # the state must fit the dataset
        for index in state.pending:
            if not 0 <= index < state.next_index:
                raise ValueError(f"RolloutState.pending holds {index}, not below next_index={state.next_index}")
            self.where(index)

    def where(self, index: int) -> tuple[int, int]:
        """``(epoch, row)`` of feed index ``index``: the feed walks the rows in order, epoch after epoch."""
        n, st = len(self.prompts), self.state
        offset = st.epoch * n + st.position + index - st.next_index
        if offset < 0 or st.position > n:
            raise ValueError(f"feed index {index} does not fit RolloutState(epoch={st.epoch}, position={st.position}, "
                             f"next_index={st.next_index}) over a dataset of {n} rows (a different dataset?)")
        return divmod(offset, n)

    def draw(self) -> tuple[str, Prompt]:
        """The next prompt to admit: a pending one (a resume's) first, then the next new one.
        Call it only once the prompt is admitted: every index below ``next_index`` was."""
        st = self.state
        index = st.pending.pop(0) if st.pending else st.next_index
        epoch, row = self.where(index)
        if index == st.next_index:
            st.epoch, st.position = self.where(index + 1)
            st.next_index += 1
        return make_sample_id(epoch, index), self.prompts[row]

    def position(self) -> dict:
        """The feed position for a checkpoint (JSON-able)."""
        st = self.state
        return {"epoch": st.epoch, "next_index": st.next_index, "position": st.position}


def encode_prompts(tokenizer, rows: Iterable[dict], encode: Callable[[Any, str], np.ndarray] | None = None) -> list[Prompt]:
    """Rows with a ``prompt`` text column (verl's convention) -> `Prompt`s."""
    out = []
    for i, row in enumerate(rows):
        text = row.get("prompt")
        if not isinstance(text, str):
            raise ValueError(f"dataset row {i}: needs a 'prompt' column of text, got {type(text).__name__}")
        ids = encode(tokenizer, text) if encode else np.asarray(tokenizer(text)["input_ids"], dtype=np.int64)
        out.append(Prompt(text=text, prompt_ids=ids))
    return out
