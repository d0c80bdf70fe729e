"""The weight-sync interface: what a syncer, a sender and a receiver do, and how they are set up.

Three backends implement it, one file each:

- ``broadcast`` (`asyncrl.sync.broadcast`): asyncrl's own group (gloo on CPU, nccl on CUDA),
  bucketed broadcast into any engine with ``load_weights`` (the built-in `TorchEngine`);
- ``vllm`` (`asyncrl.sync.vllm`): vLLM's NCCL weight-transfer engine, both halves;
- in-process (`asyncrl.sync.inprocess`): a `WeightSyncer` that copies rank 0's full state
  dict into engines living in the trainer's process (no group, no sender/receiver).

The first two are driven by `asyncrl.sync.coordinator.WeightSyncCoordinator`. The backend
is named once, by ``WeightSyncConfig.method``; the coordinator puts it in the typed init
records below, and `asyncrl.sync.backends.make_sender` / ``make_receiver`` build the matching
halves from them (this module imports no backend; the backends import it):

1. every trainer rank: ``init_weight_sync(SenderInit)`` -> `make_sender` -> `WeightSender.connect`;
   rank 0 returns one `ReceiverInit` per engine (the others return None);
2. every engine: ``init_weight_sync(ReceiverInit)`` -> `make_receiver` -> `WeightReceiver.connect`;
3. each sync: rank 0's ``weight_update_kwargs(version)`` (per-sync metadata, {} for
   ``broadcast``) goes into every engine's ``receive_weights``, concurrently with every trainer
   rank's ``send_weights``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from asyncrl.sync.config import SyncMethod
from asyncrl.sync.wire import WeightSyncError


@runtime_checkable
class WeightSyncer(Protocol):
    """What the Trainer needs: put its current weights into every engine."""

    async def sync(self) -> int:
        """Run one weight sync (pause keep, transfer, load, resume); return the new version."""
        ...


class WeightSender(Protocol):
    """The trainer's half, built in every trainer rank; only rank 0 talks to the engines."""

    def connect(self) -> list[ReceiverInit] | None:
        """Rank 0: open the group and return one `ReceiverInit` per engine; others: None."""
        ...

    def update_kwargs(self, *, version: int) -> dict:
        """Rank 0: extra ``receive_weights`` keywords of this sync ({} when none)."""
        ...

    def send(self, *, version: int) -> dict:
        """Send every parameter as ``version``; every rank calls it (gathers are collective)."""
        ...

    def close(self) -> None: ...


class WeightReceiver(Protocol):
    """The engine's half, built in an engine actor."""

    async def connect(self) -> Any:
        """Join the group; returns once the trainer's rank 0 joined too."""
        ...

    async def receive(self, *, version: int, **update) -> Any:
        """Receive one full set of weights and make it live as ``version`` (engine paused)."""
        ...

    def close(self) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class GroupInit:
    """Where the sync group meets (plain values: it crosses Ray)."""

    master_addr: str = "127.0.0.1"
    """Address trainer rank 0 hosts the rendezvous store on (``auto``: its Ray node address)."""
    master_port: int = 0
    """Port of the store; 0 = a free one picked by trainer rank 0 (reported in `ReceiverInit`)."""
    world_size: int = 2
    """1 trainer rank + every engine worker."""
    backend: str = "auto"
    """``broadcast`` only: ``gloo``, ``nccl`` or ``auto``."""
    timeout_s: float = 120.0
    """Deadline of every collective (``broadcast``: of joining too)."""
    join_timeout_s: float | None = None
    """``vllm`` only: deadline of the rendezvous (None: ``timeout_s``)."""
    group_name: str = "asyncrl-weight-sync"
    """``broadcast`` only: key prefix in the store (a new name makes a fresh group)."""

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"world_size must be >= 2 (trainer rank 0 + at least one engine worker), got {self.world_size}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.join_timeout_s is not None and self.join_timeout_s <= 0:
            raise ValueError(f"join_timeout_s must be > 0 (or None: timeout_s), got {self.join_timeout_s}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port must be in [0, 65535] (0 = pick a free port), got {self.master_port}")

    @property
    def resolved_backend(self) -> str:
        """``backend`` with ``auto`` made concrete: nccl when CUDA is available, else gloo."""
        if self.backend == "auto":
            return "nccl" if torch.cuda.is_available() else "gloo"
        return self.backend


@dataclass(frozen=True, kw_only=True)
class SenderInit:
    """What a trainer rank needs to build its `WeightSender`."""

    method: SyncMethod = "broadcast"
    group: GroupInit = field(default_factory=GroupInit)
    bucket_mb: float = 4.0
    """Bucket size in MiB (``vllm``: vLLM's ``packed_buffer_size_bytes``)."""
    workers_per_engine: int = 1
    """Group ranks each engine occupies (its tensor/pipeline-parallel workers)."""
    wire_dtype: str | None = None
    """``vllm`` only: dtype the weights travel in (None: the trainer's own dtype)."""


@dataclass(frozen=True, kw_only=True)
class ReceiverInit:
    """What one engine needs to join: rank 0's answer to `SenderInit`, one per engine."""

    method: SyncMethod = "broadcast"
    group: GroupInit = field(default_factory=GroupInit)
    rank_offset: int = 1
    """Group rank of the engine's first worker (its workers take the next ones)."""
    options: dict = field(default_factory=dict)
    """Backend-specific settings (``vllm``: packed, packed_buffer_size_bytes, packed_num_buffers)."""


# -- helpers every backend shares ------------------------------------------------------------


def full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The whole of parameter ``p``: an FSDP2 shard (DTensor) is all-gathered (a collective on the
    training world, so every rank must call it in the same order); a 1-rank mesh's local tensor is
    already the whole one (no gather, no copy)."""
    if not hasattr(p, "full_tensor"):
        return p
    if p.device_mesh.size() == 1:
        local = p.to_local()
        if local.shape == p.shape:
            return local
    return p.full_tensor()


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """This rank's own storage of ``p`` (its shard under FSDP2)."""
    return p.to_local() if hasattr(p, "to_local") else p


def node_address() -> str:
    """``auto`` address: this node's address as Ray knows it (reachable from other nodes)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


class JoinThread:
    """A blocking rendezvous run in a thread (the peers need the port it listens on first), whose
    result or error is collected by `wait` under a deadline that names its setting."""

    def __init__(self, join: Callable[[], Any], *, name: str, error: type[WeightSyncError] = WeightSyncError):
        self._error = error
        self._result: Any = None
        self._exc: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(join,), name=name, daemon=True)
        self._thread.start()

    def _run(self, join: Callable[[], Any]) -> None:
        try:
            self._result = join()
        except BaseException as exc:  # noqa: BLE001 - forwarded to wait()
            self._exc = exc

    def wait(self, timeout_s: float, what: str) -> Any:
        """The join's result; raises the backend's error when it failed or is still running after
        ``timeout_s`` (``what`` names the group and the setting)."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise self._error(f"{what} did not finish within timeout_s={timeout_s}s")
        if self._exc is not None:
            raise self._error(f"{what} failed: {self._exc}") from self._exc
        return self._result
