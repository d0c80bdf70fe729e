"""``samples.jsonl``: the audit trail of exactly-once, one line per trained or dropped group.

Each line is ``{"sample_id", "step", "status": "trained" | "dropped", "reason", "turns",
"masked_tokens"}`` (``reason`` is null for a trained group); ``turns`` and ``masked_tokens`` list,
per trajectory of the group in index order, its model turns and its response tokens the loss
never saw (a conversation's observations): ``[1, 1, ...]`` and ``[0, 0, ...]`` for plain
generation. Lines written before they existed lack the two keys. The Trainer appends a step's lines only once the step is durable
(after the checkpoint holding it is published), so the file never names a group a crash could
make the run train again. A crash between publishing a checkpoint and appending its lines, or
in the middle of a line, is repaired at resume: `SampleLog.repair` keeps exactly the lines of
groups the checkpoint's committed set holds (first occurrence, whole lines only) and appends
the checkpoint's own records (its sidecar carries them) that the file lacks. After any crash
and resume every ``sample_id`` appears at most once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Container, Iterable
from pathlib import Path
from typing import Literal, NotRequired, TypedDict

from asyncrl.types import Group


class SampleRecord(TypedDict):
    """One line of ``samples.jsonl``."""

    sample_id: str
    step: int
    """The train step that trained the group, or during whose collection it was dropped."""
    status: Literal["trained", "dropped"]
    reason: str | None
    """Why a dropped group was dropped (the drop policy's words); None when trained."""
    turns: NotRequired[list[int]]
    """Model turns of each trajectory, in index order."""
    masked_tokens: NotRequired[list[int]]
    """Response tokens of each trajectory masked out of the loss (observations), in index order."""


def _per_trajectory(group: Group) -> dict:
    ts = sorted(group.trajectories, key=lambda t: t.index)
    return {"turns": [t.turns for t in ts], "masked_tokens": [t.masked_tokens for t in ts]}


def trained(groups: Iterable[Group], step: int) -> list[SampleRecord]:
    return [{"sample_id": g.sample_id, "step": step, "status": "trained", "reason": None, **_per_trajectory(g)}
            for g in groups]


def dropped(group: Group, step: int, reason: str) -> SampleRecord:
    return {"sample_id": group.sample_id, "step": step, "status": "dropped", "reason": reason,
            **_per_trajectory(group)}


def append_transcripts(path: str | os.PathLike, groups: Iterable[Group], step: int) -> int:
    """Append the first trajectory of each group (an agent run's conversation) to
    ``transcripts.jsonl``: ``{"sample_id", "index", "step", "reward", "turns",
    "finish_reason", "prompt_ids", "response_ids", "loss_mask"}`` (``asyncrl.transcripts`` shows
    them). Written when the step trains, not when it is durable: a step trained again after a
    crash appears again. Returns the lines written."""
    lines = []
    for g in groups:
        t = min(g.trajectories, key=lambda t: t.index, default=None)
        if t is None:
            continue
        mask = t.loss_mask.tolist() if t.loss_mask is not None else [1] * len(t.response_ids)
        lines.append(json.dumps({"sample_id": g.sample_id, "index": t.index, "step": step, "reward": t.reward,
                                 "turns": t.turns, "finish_reason": t.finish_reason,
                                 "prompt_ids": t.prompt_ids.tolist(), "response_ids": t.response_ids.tolist(),
                                 "loss_mask": mask}) + "\n")
    if lines:
        with open(path, "a") as f:
            f.write("".join(lines))
    return len(lines)


class SampleLog:
    """Appends records to one ``samples.jsonl`` and repairs it at resume."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def append(self, records: Iterable[SampleRecord]) -> None:
        """Append whole lines and fsync: they are on disk when this returns."""
        text = "".join(json.dumps(r) + "\n" for r in records)
        if not text:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[SampleRecord]:
        """Every whole line (a torn last line, cut by a crash mid-write, is left out)."""
        if not self.path.exists():
            return []
        text = self.path.read_text()
        lines = text.split("\n")[:-1]  # the part after the last newline is torn or empty
        return [json.loads(line) for line in lines if line]

    def repair(self, committed: Container[str], recent: Iterable[SampleRecord]) -> int:
        """Make the file list exactly once what the restored checkpoint made durable.

        Keeps the first line of each ``sample_id`` in ``committed``; appends the ``recent``
        records (the checkpoint's own) the file lacks. Returns how many lines changed.
        """
        before = self.read()
        kept: list[SampleRecord] = []
        seen: set[str] = set()
        for rec in before:
            if rec["sample_id"] in committed and rec["sample_id"] not in seen:
                seen.add(rec["sample_id"])
                kept.append(rec)
        added = [r for r in recent if r["sample_id"] not in seen]
        torn = self.path.exists() and not self.path.read_bytes().endswith(b"\n") and self.path.stat().st_size > 0
        if len(kept) == len(before) and not torn:
            self.append(added)
            return len(added)
        tmp = self.path.with_name(self.path.name + ".part")
        with open(tmp, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in kept + added))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        return len(before) - len(kept) + len(added)
