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

The coordinator drives it like this (trainer ranks all call `send`; only rank 0 talks NCCL)::

    sender = VLLMWeightSender(cfg, rank=trainer_rank, workers_per_engine=[tp * pp, ...])
    # once, concurrently:  rank 0: sender.connect()
    #                      engine i: engine_actor.init_weight_sync(**sender.engine_init_infos()[i])
    # each sync: engines pause(mode="keep", clear_cache=False); then concurrently:
    #   engine i: engine_actor.receive_weights(**sender.update_info(metas), version=v + 1)
    #   every trainer rank: sender.send(iter_full_tensors(model))
    # then engines resume().

Leaves out: the unique-id (torch-free) rendezvous, CUDA-IPC (colocated) transfer, the
sparse and m2n backends, and sending from more than one trainer rank. Nothing here can run
without CUDA and vLLM; the geometry and packing are pure torch and tested on CPU.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

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
    """Deadline of the rendezvous in `VLLMWeightSender.connect`."""

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


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (vLLM's TCPStore binds it at `connect`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def broadcast_packed(
    pairs: Iterable[tuple[str, torch.Tensor]],
    metas: Sequence[TensorMeta],
    *,
    bucket_bytes: int,
    broadcast: Callable[[torch.Tensor, object], None],
    device: torch.device,
    streams: Sequence[object | None],
) -> int:
    """Pack ``pairs`` into vLLM-geometry buckets and hand each to ``broadcast(buffer, stream)``.

    Bucket ``b`` uses slot ``b % len(streams)``: before re-using a slot its previous bucket
    must have left (the slot's stream is synchronized), so at most ``len(streams)`` buckets
    are held and packing one overlaps sending another. Each incoming tensor is copied into
    the bucket and dropped, so a gathered full tensor lives only until it is packed.
    Checks every pair against ``metas`` (the receiver cuts its buckets from them). Returns
    the bytes sent.
    """
    plan = plan_vllm_buckets([m.nbytes for m in metas], bucket_bytes)
    it = iter(pairs)
    held: list[torch.Tensor | None] = [None] * len(streams)
    sent = 0
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
    extra = next(it, None)
    if extra is not None:
        raise ValueError(f"weight source yielded {extra[0]!r} beyond the {len(metas)} tensors in the metadata")
    for stream in streams:
        if stream is not None:
            stream.synchronize()
    return sent


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


class VLLMWeightSender:
    """The trainer's side of vLLM's NCCL weight transfer (see the module docstring).

    Built on every trainer rank; only rank 0 opens the NCCL endpoint and broadcasts, the
    other ranks only join the FSDP2 gathers inside `send`.
    """

    def __init__(
        self,
        config: VLLMSyncConfig | None = None,
        *,
        rank: int,
        workers_per_engine: Sequence[int],
        device: torch.device | str | None = None,
    ) -> None:
        self.config = config or VLLMSyncConfig()
        self.rank = rank
        self.workers_per_engine = list(workers_per_engine)
        self.port = self.config.master_port or (free_port(self.config.master_address) if rank == 0 else 0)
        self.device = torch.device(device) if device is not None else None
        self._comm = None
        self._streams: list[object | None] = []
        self._sent_metas: list[TensorMeta] | None = None

    @property
    def world_size(self) -> int:
        return 1 + sum(self.workers_per_engine)

    def engine_init_infos(self) -> list[dict]:
        """What each engine's ``init_weight_sync(**info)`` takes, in engine order (rank 0 only)."""
        self._require_rank0("engine_init_infos")
        return engine_init_infos(
            master_address=self.config.master_address,
            master_port=self.port,
            workers_per_engine=self.workers_per_engine,
            packed=self.config.packed,
            bucket_bytes=self.config.bucket_bytes,
            num_buffers=self.config.num_buffers,
        )

    def connect(self) -> None:
        """Open the NCCL endpoint as rank 0; returns once every engine worker has joined.

        Call it while the engines run ``init_weight_sync`` (both sides block in one
        rendezvous). Uses the current CUDA device unless ``device`` was given.
        """
        self._require_rank0("connect")
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        if self.device is not None:
            torch.cuda.set_device(self.device)
        self.device = torch.device("cuda", torch.cuda.current_device())
        rendezvous = {
            "master_address": self.config.master_address,
            "master_port": self.port,
            "world_size": self.world_size,
        }
        self._comm = _call_with_deadline(
            lambda: trainer_init(rendezvous),
            self.config.timeout_s,
            f"vLLM weight-transfer rendezvous at {self.config.master_address}:{self.port} "
            f"({self.world_size} ranks) did not complete within VLLMSyncConfig.timeout_s="
            f"{self.config.timeout_s}s; did every engine call init_weight_sync?",
        )
        self._streams = [torch.cuda.Stream(device=self.device) for _ in range(self.config.num_buffers)]
        self._sent_metas = None  # vLLM's init_transfer_engine forgets the engines' cached metadata

    def forget_metadata(self) -> None:
        """Send full metadata at the next sync (e.g. after an engine was restarted)."""
        self._sent_metas = None

    def update_info(self, metas: Sequence[TensorMeta]) -> dict[str, list]:
        """The ``receive_weights`` kwargs of this sync: full metadata once, empty lists while unchanged."""
        metas = list(metas)
        if metas == self._sent_metas:
            return {"names": [], "dtype_names": [], "shapes": []}
        if self.config.packed:
            check_vllm_alignment(metas, self.config.bucket_bytes)
        return update_info(metas)

    def send(self, pairs: Iterable[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta]) -> int:
        """Broadcast one full set of weights; call on every trainer rank, while the engines run
        ``receive_weights``. ``pairs`` yields ``(name, full tensor)`` in ``metas`` order
        (`iter_full_tensors`). Returns the bytes broadcast (0 on ranks other than 0)."""
        metas = list(metas)
        if self.rank != 0:
            for _ in pairs:  # join the FSDP2 all-gathers that rank 0's iteration runs
                pass
            return 0
        if self._comm is None:
            raise RuntimeError("VLLMWeightSender.send before connect(): open the NCCL endpoint first")
        comm = self._comm
        if self.config.packed:
            sent = broadcast_packed(
                pairs,
                metas,
                bucket_bytes=self.config.bucket_bytes,
                broadcast=lambda buf, stream: comm.broadcast(buf, src=0, stream=stream),
                device=self.device,
                streams=self._streams,
            )
        else:
            sent = self._send_unpacked(pairs, metas)
        self._sent_metas = metas
        return sent

    def _send_unpacked(self, pairs: Iterable[tuple[str, torch.Tensor]], metas: list[TensorMeta]) -> int:
        # vLLM's unpacked path: one broadcast per tensor, in metadata order, on the current stream.
        it, sent = iter(pairs), 0
        stream = torch.cuda.current_stream()
        for i in range(len(metas)):
            _, tensor = _next_checked(it, metas, i)
            tensor = tensor.to(self.device).contiguous()
            self._comm.broadcast(tensor, src=0, stream=stream)
            sent += metas[i].nbytes
        stream.synchronize()
        return sent

    def close(self) -> None:
        """Tear down the NCCL communicator (rank 0); the engines keep serving."""
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None

    def _require_rank0(self, what: str) -> None:
        if self.rank != 0:
            raise RuntimeError(f"VLLMWeightSender.{what} runs on trainer rank 0 only (this is rank {self.rank})")


def _call_with_deadline(fn: Callable[[], object], timeout_s: float, message: str):
    # The rendezvous blocks in C++ (TCPStore, ncclCommInitRank) and cannot be cancelled, so it
    # runs in a daemon thread; on timeout we raise and leave the thread to the process exit.
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            result["error"] = exc

    thread = threading.Thread(target=run, name="vllm-weight-transfer-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(message)
    if "error" in result:
        raise result["error"]
    return result["value"]
