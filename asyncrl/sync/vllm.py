"""Trainer-side sender for vLLM's NCCL weight-transfer engine (written against vLLM 0.33).

vLLM engines receive weights through vLLM's own transfer engine
(``weight_transfer_config={"backend": "nccl"}``), not through asyncrl's `WeightSyncGroup`:
their workers join a group that vLLM builds (a ``StatelessProcessGroup`` over a TCPStore
plus a ``PyNcclCommunicator``), which a torch.distributed group cannot join. This module is
the trainer's half of that protocol. The facts it relies on, read from vLLM 0.33's
``distributed/weight_transfer/{nccl_engine,nccl_common,packed_tensor}.py``:

- Group: trainer rank 0 is NCCL rank 0 and hosts the TCPStore at
  ``master_address:master_port``. A worker of an engine sits at
  ``rank_offset + dp_rank * (tp * pp) + rank_in_dp``; ``world_size`` = 1 + every worker.
  Each engine (one ``AsyncLLM``) gets its own ``rank_offset`` (`engine_init_infos`).
- Handshake (once): every engine runs ``init_weight_transfer_engine(init_info)`` while
  trainer rank 0 runs `VLLMWeightSender.connect`; both block in the same rendezvous.
- Update (each sync): engines run ``start_weight_update``, then
  ``update_weights({names, dtype_names, shapes})`` *while* the trainer broadcasts, then
  ``finish_weight_update``. Empty lists mean "same metadata as last time"
  (`VLLMWeightSender.update_info` sends names/dtypes/shapes once).
- Packed geometry (`plan_vllm_buckets`): tensors in metadata order, raw bytes, no padding;
  a bucket closes right after the tensor that takes its total past
  ``packed_buffer_size_bytes`` (that tensor included), or at the end. One NCCL broadcast
  per bucket from rank 0. Both sides derive the same cut points from the same metadata.

The order of calls (all trainer ranks build the sender and call `send`)::

    sender = VLLMWeightSender(model, rank=trainer_rank, workers_per_engine=[tp * pp, ...])
    infos = sender.connect()                      # rank 0: one dict per engine, join in background
    # once:       engine i: engine_actor.init_weight_sync(**infos[i])
    # each sync:  every engine: pause(mode="keep", clear_cache=False)
    #             kw = sender.weight_update_kwargs(version=v + 1)       # rank 0
    #             concurrently: every engine receive_weights(**kw); every trainer rank send(version=v + 1)
    #             every engine: resume()

`asyncrl.sync.coordinator.WeightSyncCoordinator` runs exactly this when a trainer rank's
``init_weight_sync`` returns `connect`'s list, its ``send_weights`` calls `send`, and it
exposes ``weight_update_kwargs``; `VLLMWeightSender.from_group_kwargs` builds the sender
from the kwargs the coordinator passes. A failed transfer is not retried into a vLLM
engine: vLLM's worker stays inside the failed update, so the engine stays paused and is
reported (it never resumes on half-loaded weights; rebuild it).

Leaves out: the unique-id (torch-free) rendezvous, CUDA-IPC (colocated) transfer, the
sparse and m2n backends, and sending from more than one trainer rank. Nothing here can run
without CUDA and vLLM; the geometry and packing are pure torch and tested on CPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from asyncrl.net import free_port

VLLM_DEFAULT_BUCKET_BYTES = 1024 * 1024 * 1024
"""vLLM 0.33's ``DEFAULT_PACKED_BUFFER_SIZE_BYTES`` (1 GiB)."""


@dataclass(kw_only=True)
class VLLMSyncConfig:
    """How the trainer reaches vLLM's NCCL weight-transfer engine."""

    master_address: str = "127.0.0.1"
    """Address of trainer rank 0, where vLLM's TCPStore rendezvous is hosted."""
    master_port: int = 0
    """Port of that TCPStore; 0 picks a free one when the sender is built."""
    bucket_mb: float = 1024.0
    """Packed bucket threshold in MiB (vLLM's ``packed_buffer_size_bytes``; its default is 1 GiB)."""
    num_buffers: int = 2
    """Buckets in flight at once on each side (vLLM's ``packed_num_buffers``)."""
    packed: bool = True
    """Packed buckets (True) or one broadcast per tensor (False), vLLM's ``packed``."""
    timeout_s: float = 600.0
    """How long `VLLMWeightSender.send` waits for every engine worker to have joined the group."""

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            raise ValueError(f"VLLMSyncConfig.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.num_buffers < 1:
            raise ValueError(f"VLLMSyncConfig.num_buffers must be >= 1, got {self.num_buffers}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"VLLMSyncConfig.master_port must be in [0, 65535], got {self.master_port}")
        if self.timeout_s <= 0:
            raise ValueError(f"VLLMSyncConfig.timeout_s must be > 0, got {self.timeout_s}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 1024 * 1024)


@dataclass(frozen=True)
class TensorMeta:
    """Name, wire dtype and full shape of one tensor the trainer sends."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= int(d)
        return n


def vllm_dtype_name(dtype: torch.dtype) -> str:
    """The name vLLM's worker resolves with ``getattr(torch, name)``: ``torch.bfloat16`` -> ``bfloat16``."""
    return str(dtype).split(".")[-1]


def plan_vllm_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[range]:
    """Cut tensors of ``sizes`` bytes (in send order) into buckets the way vLLM 0.33 does.

    A bucket takes tensors until its total *exceeds* ``bucket_bytes``; the tensor that
    crosses the line stays in it. Returns the index range of each bucket.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > bucket_bytes:
            buckets.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        buckets.append(range(start, len(sizes)))
    return buckets


def check_vllm_alignment(metas: Sequence[TensorMeta], bucket_bytes: int) -> None:
    """Raise ValueError if vLLM 0.33's packed receiver could not view a tensor in its bucket.

    vLLM unpacks with ``bucket.split(sizes)[i].view(dtype)``, which needs each tensor's byte
    offset inside the bucket to be a multiple of its element size (e.g. 7 bf16 values
    followed by an int64 are not). Failing here, before anything is sent, beats the
    engines failing half way through an update.
    """
    for idx in plan_vllm_buckets([m.nbytes for m in metas], bucket_bytes):
        offset = 0
        for i in idx:
            m = metas[i]
            if offset % m.dtype.itemsize:
                raise ValueError(
                    f"{m.name!r} ({m.dtype}) would start at byte {offset} of its packed bucket, which vLLM's "
                    f"receiver cannot view as {m.dtype}; set VLLMSyncConfig.packed=False or change bucket_mb"
                )
            offset += m.nbytes


def update_info(metas: Sequence[TensorMeta]) -> dict[str, list]:
    """vLLM's ``NCCLWeightTransferUpdateInfo`` as plain lists (what ``update_weights`` takes)."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [vllm_dtype_name(m.dtype) for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def engine_init_infos(
    *,
    master_address: str,
    master_port: int,
    workers_per_engine: Sequence[int],
    packed: bool = True,
    bucket_bytes: int = VLLM_DEFAULT_BUCKET_BYTES,
    num_buffers: int = 2,
) -> list[dict]:
    """One ``init_weight_transfer_engine`` payload per engine (vLLM's ``NCCLWeightTransferInitInfo``).

    ``workers_per_engine[i]`` is engine i's worker count (``dp * tp * pp`` of that AsyncLLM).
    Engines are laid out after trainer rank 0, one contiguous rank range each.
    """
    if not workers_per_engine or any(w < 1 for w in workers_per_engine):
        raise ValueError(f"workers_per_engine needs one count >= 1 per engine, got {list(workers_per_engine)}")
    world_size = 1 + sum(workers_per_engine)
    infos, offset = [], 1
    for workers in workers_per_engine:
        infos.append(
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": offset,
                "world_size": world_size,
                "packed": packed,
                "packed_buffer_size_bytes": bucket_bytes,
                "packed_num_buffers": num_buffers,
            }
        )
        offset += workers
    return infos


def model_tensor_metas(model: torch.nn.Module) -> list[TensorMeta]:
    """Metadata of ``model.named_parameters()`` (tied weights once, global shapes under FSDP2)."""
    return [TensorMeta(name, p.dtype, tuple(p.shape)) for name, p in model.named_parameters()]


def iter_full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)``; an FSDP2 shard (DTensor) is all-gathered, so every rank must iterate."""
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        yield name, full.detach()


def broadcast_packed(
    pairs: Iterable[tuple[str, torch.Tensor]],
    metas: Sequence[TensorMeta],
    *,
    bucket_bytes: int,
    broadcast: Callable[[torch.Tensor, object], None],
    device: torch.device,
    streams: Sequence[object | None],
) -> tuple[int, int]:
    """Pack ``pairs`` into vLLM-geometry buckets and hand each to ``broadcast(buffer, stream)``.

    Bucket ``b`` uses slot ``b % len(streams)``: before re-using a slot its previous bucket
    must have left (the slot's stream is synchronized), so at most ``len(streams)`` buckets
    are held and packing one overlaps sending another. Each incoming tensor is copied into
    the bucket and dropped, so a gathered full tensor lives only until it is packed.
    Checks every pair against ``metas`` (the receiver cuts its buckets from them). Returns
    ``(bytes sent, peak bytes of bucket buffers held at once)``.
    """
    plan = plan_vllm_buckets([m.nbytes for m in metas], bucket_bytes)
    it = iter(pairs)
    held: list[torch.Tensor | None] = [None] * len(streams)
    sent = peak = 0
    for b, idx in enumerate(plan):
        slot = b % len(streams)
        stream = streams[slot]
        if stream is not None:
            stream.synchronize()
        held[slot] = None
        if stream is not None:
            # Parameters were last written on the caller's stream (optimizer step).
            stream.wait_stream(torch.cuda.current_stream(device))
        ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with ctx:
            nbytes = sum(metas[i].nbytes for i in idx)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            offset = 0
            for i in idx:
                name, tensor = _next_checked(it, metas, i)
                raw = tensor.contiguous().view(-1).view(torch.uint8)
                buf[offset : offset + raw.numel()].copy_(raw, non_blocking=True)
                offset += raw.numel()
                del tensor, raw
            broadcast(buf, stream)
            held[slot] = buf
            sent += nbytes
            peak = max(peak, sum(h.numel() for h in held if h is not None))
    extra = next(it, None)
    if extra is not None:
        raise ValueError(f"weight source yielded {extra[0]!r} beyond the {len(metas)} tensors in the metadata")
    for stream in streams:
        if stream is not None:
            stream.synchronize()
    return sent, peak


def _next_checked(it: Iterator, metas: Sequence[TensorMeta], i: int) -> tuple[str, torch.Tensor]:
    expected = metas[i]
    try:
        name, tensor = next(it)
    except StopIteration:
        raise ValueError(
            f"weight source ended after {i} tensors; the metadata declares {len(metas)} "
            f"(next expected {expected.name!r}) and the engines are waiting for them"
        ) from None
    if name != expected.name or tensor.dtype != expected.dtype or tuple(tensor.shape) != expected.shape:
        raise ValueError(
            f"weight source disagrees with the metadata at index {i}: declared {expected.name!r} "
            f"{expected.dtype} {expected.shape}, got {name!r} {tensor.dtype} {tuple(tensor.shape)}"
        )
    return name, tensor


class VLLMWeightSyncError(RuntimeError):
    """A vLLM weight sync failed; the message names the step and the setting involved."""


class VLLMWeightSender:
    """The trainer's side of vLLM's NCCL weight transfer, shaped like `asyncrl.sync.sender.WeightSender`.

    Built on every trainer rank around the (possibly FSDP2-sharded) model; every rank calls
    `send` (the all-gathers are collectives), only rank 0 opens the NCCL endpoint and
    broadcasts. See the module docstring for the order of calls.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        rank: int,
        workers_per_engine: Sequence[int],
        config: VLLMSyncConfig | None = None,
    ) -> None:
        self.model = model
        self.rank = rank
        self.config = config or VLLMSyncConfig()
        self.workers_per_engine = list(workers_per_engine)
        if not self.workers_per_engine or any(w < 1 for w in self.workers_per_engine):
            raise ValueError(f"workers_per_engine needs one count >= 1 per engine, got {self.workers_per_engine}")
        self.port = 0
        self.device: torch.device | None = None
        self._comm = None
        self._join_thread: threading.Thread | None = None
        self._join_result: dict = {}
        self._streams: list[object | None] = []
        self._announced: list[TensorMeta] | None = None
        self.stats = {"syncs": 0, "meta_sends": 0, "bytes_sent": 0, "peak_extra_bytes": 0, "last_send_s": 0.0}

    @classmethod
    def from_group_kwargs(
        cls,
        model: torch.nn.Module,
        *,
        rank: int,
        world_size: int,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        bucket_mb: float = 1024.0,
        timeout_s: float = 600.0,
        workers_per_engine: int = 1,
        **_unused,
    ) -> VLLMWeightSender:
        """Build from the kwargs `asyncrl.sync.coordinator` passes a trainer rank's ``init_weight_sync``
        (``backend``/``group_name`` do not apply: vLLM always builds its own NCCL group)."""
        engines, rest = divmod(world_size - 1, workers_per_engine)
        if engines < 1 or rest:
            raise ValueError(f"world_size={world_size} is not 1 + engines * workers_per_engine={workers_per_engine}")
        config = VLLMSyncConfig(master_address=master_addr, master_port=master_port, bucket_mb=bucket_mb, timeout_s=timeout_s)
        return cls(model, rank=rank, workers_per_engine=[workers_per_engine] * engines, config=config)

    @property
    def world_size(self) -> int:
        return 1 + sum(self.workers_per_engine)

    def metas(self) -> list[TensorMeta]:
        """What is sent, in order: `model_tensor_metas` of the model."""
        return model_tensor_metas(self.model)

    # -- rendezvous ---------------------------------------------------------------------------

    def connect(self) -> list[dict] | None:
        """Rank 0: start joining vLLM's group; return one ``init_weight_sync`` kwargs dict per engine.

        The join (vLLM's ``trainer_init`` on the current CUDA device) finishes only when every
        engine worker has called ``init_weight_sync`` with its dict, so it runs in a thread and
        `send` waits for it. Other ranks: nothing to do, None.
        """
        if self.rank != 0:
            return None
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.port = self.config.master_port or free_port(self.config.master_address)
        self.device = torch.device("cuda", torch.cuda.current_device())
        rendezvous = {"master_address": self.config.master_address, "master_port": self.port, "world_size": self.world_size}

        def join() -> None:
            try:
                torch.cuda.set_device(self.device)
                self._join_result["comm"] = trainer_init(rendezvous)
            except BaseException as exc:  # noqa: BLE001 - forwarded to send()
                self._join_result["error"] = exc

        self._join_thread = threading.Thread(target=join, name="vllm-weight-transfer-join", daemon=True)
        self._join_thread.start()
        self._announced = None  # vLLM's init_transfer_engine forgets the engines' cached metadata
        return engine_init_infos(
            master_address=self.config.master_address,
            master_port=self.port,
            workers_per_engine=self.workers_per_engine,
            packed=self.config.packed,
            bucket_bytes=self.config.bucket_bytes,
            num_buffers=self.config.num_buffers,
        )

    def _wait_joined(self):
        if self._comm is not None:
            return self._comm
        if self._join_thread is None:
            raise VLLMWeightSyncError("VLLMWeightSender.send before connect(): open the NCCL endpoint first")
        self._join_thread.join(self.config.timeout_s)
        if self._join_thread.is_alive():
            raise VLLMWeightSyncError(
                f"vLLM engines did not join the weight-transfer group at {self.config.master_address}:{self.port} "
                f"({self.world_size} ranks) within VLLMSyncConfig.timeout_s={self.config.timeout_s}s; "
                "did every engine run init_weight_sync?"
            )
        self._join_thread = None
        if "error" in self._join_result:
            err = self._join_result.pop("error")
            raise VLLMWeightSyncError(f"joining vLLM's weight-transfer group failed: {err}") from err
        self._comm = self._join_result.pop("comm")
        self._streams = [torch.cuda.Stream(device=self.device) for _ in range(self.config.num_buffers)]
        return self._comm

    # -- one sync -----------------------------------------------------------------------------

    def weight_update_kwargs(self, *, version: int) -> dict:
        """Rank 0: the ``receive_weights`` kwargs every vLLM engine gets for this sync.

        Names/dtypes/shapes go on the first sync after `connect` and whenever they change;
        otherwise empty lists, which vLLM reads as "same as last time".
        """
        metas = self.metas()
        if self.config.packed:
            check_vllm_alignment(metas, self.config.bucket_bytes)
        if metas == self._announced:
            return {"names": [], "dtype_names": [], "shapes": [], "version": version}
        self._announced = metas
        self.stats["meta_sends"] += 1
        return {**update_info(metas), "version": version}

    def forget_metadata(self) -> None:
        """Announce full metadata at the next sync (e.g. after an engine was rebuilt)."""
        self._announced = None

    @torch.no_grad()
    def send(self, *, version: int) -> dict:
        """Broadcast every parameter; all trainer ranks call it while the engines run
        ``receive_weights(**weight_update_kwargs(version=...))``. Returns stats."""
        start = time.perf_counter()
        metas = self.metas()
        pairs = iter_full_tensors(self.model)
        if self.rank != 0:
            for _ in pairs:  # join the FSDP2 all-gathers rank 0's iteration runs
                pass
            return {**self.stats, "version": version}
        comm = self._wait_joined()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # send may run in a thread other than connect's caller
        try:
            if self.config.packed:
                sent, peak = broadcast_packed(
                    pairs,
                    metas,
                    bucket_bytes=self.config.bucket_bytes,
                    broadcast=lambda buf, stream: comm.broadcast(buf, src=0, stream=stream),
                    device=self.device,
                    streams=self._streams,
                )
            else:
                sent, peak = self._send_unpacked(comm, pairs, metas), 0
        except BaseException as exc:
            for _ in pairs:  # finish the gathers so the other trainer ranks do not hang
                pass
            self._announced = None
            raise VLLMWeightSyncError(f"broadcast of weights version {version} to vLLM failed: {exc}") from exc
        self.stats["syncs"] += 1
        self.stats["bytes_sent"] += sent
        self.stats["peak_extra_bytes"] = max(self.stats["peak_extra_bytes"], peak)
        self.stats["last_send_s"] = time.perf_counter() - start
        return {**self.stats, "version": version, "bytes": sent}

    def _send_unpacked(self, comm, pairs: Iterator[tuple[str, torch.Tensor]], metas: list[TensorMeta]) -> int:
        # vLLM's unpacked path: one broadcast per tensor, in metadata order, on the current stream.
        stream, sent = torch.cuda.current_stream(), 0
        for i in range(len(metas)):
            _, tensor = _next_checked(pairs, metas, i)
            comm.broadcast(tensor.to(self.device).contiguous(), src=0, stream=stream)
            sent += metas[i].nbytes
        stream.synchronize()
        return sent

    def close(self) -> None:
        """Tear down the NCCL communicator (rank 0); the engines keep serving. Safe to call twice."""
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None

