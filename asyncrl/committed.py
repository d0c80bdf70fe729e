"""`CommittedSet`: the ``sample_id``s a run is done with, kept small however long the run.

Split out of `asyncrl.types` (which re-exports it, its public home) to keep that module to
the records themselves.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable, Iterator, Set
from typing import Any


# The stream's consumer asks about each id twice (is it a duplicate when it arrives, then
# add it when it is acked): a memo of the ids in flight makes the second a dict lookup.
@functools.lru_cache(maxsize=8192)
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
