"""Checkpoints: model + optimizer shards via torch.distributed.checkpoint, plus a JSON sidecar.

Layout under ``checkpoint_dir``::

    step_000012/           one checkpoint: DCP shard files + trainer_state.json
    latest                 the name of the newest complete checkpoint (replaced atomically)

A checkpoint is written into ``step_N.tmp`` and renamed when both the shards and the sidecar
are on disk, then ``latest`` is replaced; a crash mid-write leaves the previous checkpoint as
``latest``. The sidecar holds the trainer's ``version`` and ``step``, the ``committed``
sample_ids (trained or dropped by policy, as a `CommittedSet`: a watermark plus exceptions, so
it stays small however long the run), the records this checkpoint made durable (to repair
``samples.jsonl`` after a crash) and a ``rollouter_state`` slot (feed position, partial buffer)
that the Rollouter fills.

Leaves out: pruning old checkpoints and async (background) saving.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from asyncrl.trainer.config import TrainerConfig

SIDECAR = "trainer_state.json"
LATEST = "latest"


@dataclass(kw_only=True)
class TrainerState:
    """What the sidecar of one checkpoint records."""

    step: int
    """Train steps completed."""
    version: int
    """Weight version (number of weight syncs) at the checkpoint."""
    committed: dict | list = field(default_factory=dict)
    """sample_ids already trained on or dropped by policy (`CommittedSet.to_json`; older
    sidecars hold a plain list); a resumed run never trains them again."""
    dropped: int = 0
    """How many of them were dropped by policy (the rest were trained)."""
    records: list[dict] = field(default_factory=list)
    """The ``samples.jsonl`` records of the groups this checkpoint made durable."""
    rollouter_state: dict = field(default_factory=dict)
    """The Rollouter's state (feed index, partial buffer, unacked groups); opaque to the trainer."""
    sync_due: bool = False
    """The weight sync due after ``step`` did not finish (the run stopped in it): ``version``
    lags the weights by that sync, and a resume runs it (`Trainer.catch_up_sync`) before any
    generation, so the engines serve these weights as the version an uninterrupted run gives them."""


def save_shards(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, optim_steps: int,
                adapters_only: bool = False) -> None:
    """Every rank writes its shard of model + optimizer state to ``path`` (collective); with
    ``adapters_only`` (LoRA) the frozen base is left out: it is the model directory's, unchanged."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(ignore_frozen_params=adapters_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    model_sd = _trainable_only(model, model_sd) if adapters_only else model_sd
    dcp.save({"model": model_sd, "optim": optim_sd, "progress": {"optim_steps": torch.tensor(optim_steps)}},
             checkpoint_id=path)


def load_shards(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                adapters_only: bool = False) -> int:
    """Load ``path`` into the sharded model and optimizer (collective); returns the optimizer steps.
    ``adapters_only`` as `save_shards` wrote it (the base stays as loaded from the model directory)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    opts = StateDictOptions(ignore_frozen_params=adapters_only, strict=not adapters_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    model_sd = _trainable_only(model, model_sd) if adapters_only else model_sd
    state = {"model": model_sd, "optim": optim_sd, "progress": {"optim_steps": torch.tensor(0)}}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts)
    return int(state["progress"]["optim_steps"])


def _trainable_only(model: torch.nn.Module, model_sd: dict) -> dict:
    # ignore_frozen_params keeps a frozen weight tied to another (a tied LM head): drop it by hand
    trainable = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {k: v for k, v in model_sd.items() if k in trainable}


def staging_path(root: str | os.PathLike, step: int) -> Path:
    """Where the ranks write the shards of the checkpoint of ``step`` before it is published."""
    path = Path(root) / f"step_{step:06d}.tmp"
    if path.exists():
        shutil.rmtree(path)  # left by a crash mid-write; never published
    path.mkdir(parents=True)
    return path


def publish(root: str | os.PathLike, staged: Path, state: TrainerState) -> Path:
    """Write the sidecar into ``staged``, rename it to its final name and point ``latest`` at it."""
    root = Path(root)
    _write_atomic(staged / SIDECAR, json.dumps(asdict(state)))
    final = root / staged.name.removesuffix(".tmp")
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    _write_atomic(root / LATEST, final.name)
    return final


def latest(root: str | os.PathLike) -> tuple[Path, TrainerState] | None:
    """The newest published checkpoint under ``root`` and its sidecar, or None if there is none."""
    root = Path(root)
    pointer = root / LATEST
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    data = json.loads((path / SIDECAR).read_text())
    return path, TrainerState(**data)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RankCalls(Protocol):
    """What `load_latest` needs of the ranks (`asyncrl.trainer.ranks.RankGroup`): one call on each."""

    async def call(self, method: str, *args: Any, timeout: float, **kwargs: Any) -> Any: ...


async def load_latest(cfg: TrainerConfig, ranks: RankCalls) -> TrainerState | None:
    """Load the latest checkpoint under ``checkpoint_dir`` into the ranks (model, optimizer); its
    state, for ``Trainer(restored=...)``, or None without one (``samples.jsonl`` then lists
    nothing: a run started again before its first checkpoint made nothing durable)."""
    found = latest(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if found is None:
        from asyncrl.trainer import audit
        from asyncrl.types import CommittedSet

        if cfg.samples_path:
            audit.SampleLog(cfg.samples_path).repair(CommittedSet(), ())
        return None
    path, state = found
    await ranks.call("load_checkpoint", timeout=cfg.step_timeout_s, path=str(path))
    return state
