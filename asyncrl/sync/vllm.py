"""The ``vllm`` weight-sync backend: vLLM's NCCL weight-transfer engine, both halves (vLLM 0.32 and 0.33, GPU).

vLLM engines receive weights through vLLM's own transfer engine
(``weight_transfer_config={"backend": "nccl"}``), not through asyncrl's `WeightSyncGroup`:
their workers join a group that vLLM builds (a ``StatelessProcessGroup`` over a TCPStore
plus a ``PyNcclCommunicator``), which a torch.distributed group cannot join. The facts this
relies on, read from vLLM 0.33.0's
``distributed/weight_transfer/{nccl_engine,nccl_common,packed_tensor}.py``:

- Group: trainer rank 0 is NCCL rank 0 and hosts the TCPStore at
  ``master_address:master_port``. A worker of an engine sits at
  ``rank_offset + dp_rank * (tp * pp) + rank_in_dp``; ``world_size`` = 1 + every worker.
  Each engine (one ``AsyncLLM``) gets its own ``rank_offset`` (`engine_init_infos`).
- Handshake (once): every engine runs ``init_weight_transfer_engine(init_info)`` while
  trainer rank 0 runs `VLLMWeightSender.connect`; both block in the same rendezvous.
- Update (each sync): engines run ``start_weight_update``, then
  ``update_weights({names, dtype_names, shapes})`` *while* the trainer broadcasts, then
  ``finish_weight_update``. `VLLMWeightSender.update_kwargs` sends the full names/dtypes/
  shapes every sync: vLLM 0.33 reads empty lists as "same as last time", 0.32 does not.
  On 0.32 the engines unpack with one buffer (its packed receiver has no ordering between
  buffers); 0.33 takes ``packed_num_buffers`` as sent.
- Packed geometry (`plan_vllm_buckets`): tensors in metadata order, raw bytes, no padding;
  a bucket closes right after the tensor that takes its total past
  ``packed_buffer_size_bytes`` (that tensor included), or at the end. One NCCL broadcast
  per bucket from rank 0. Both sides derive the same cut points from the same metadata.

Both halves live here: `VLLMWeightSender` (every trainer rank) and `VLLMWeightReceiver` (the
engine actor, driving its ``AsyncLLM``). `asyncrl.sync.coordinator.WeightSyncCoordinator` runs
them with ``WeightSyncConfig(method="vllm")``::

    trainer ranks:  init_weight_sync(SenderInit)   # rank 0 returns one ReceiverInit per engine
    engine i:       init_weight_sync(ReceiverInit) # init_weight_transfer_engine; joins the group
    each sync:      every engine: pause(mode="keep", clear_cache=False)
                    kw = rank 0's weight_update_kwargs(version=v + 1)
                    concurrently: every engine receive_weights(version=v + 1, **kw); every trainer rank send_weights
                    every engine: resume()

Deadlines are the coordinator's settings: the rendezvous waits ``connect_timeout_s`` on both
sides (the trainer builds vLLM's ``StatelessProcessGroup`` itself with that store timeout; the
engines' workers wait vLLM's fixed 300 s, so a longer setting is refused), each update step
``transfer_timeout_s``. Weights travel in ``WeightSyncConfig.wire_dtype`` (the engine's dtype
by default: bf16 halves fp32's bytes). A failed or timed-out step is not retried into a vLLM
engine: its worker may still be inside the step, so the engine stays paused, refuses every
later weight call and ``resume()`` (it never serves half-loaded weights; rebuild it).

Leaves out: the unique-id (torch-free) rendezvous, CUDA-IPC (colocated) transfer, the
sparse and m2n backends, and sending from more than one trainer rank. What was checked
against vLLM 0.33.0's source and what only a GPU run can confirm: docs/vllm.md. The
geometry, packing, deadlines and failure paths are tested on CPU with stand-ins for vLLM.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from asyncrl.net import free_port
from asyncrl.sync.base import GroupInit, JoinThread, ReceiverInit, SenderInit, full_tensor, node_address
from asyncrl.sync.wire import (
    VLLM_DEFAULT_BUCKET_BYTES,
    VLLM_STORE_TIMEOUT_S,
    VLLMWeightSyncError,
    dtype_from_name,
    dtype_name,
)


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
    join_timeout_s: float = 120.0
    """Deadline of the rendezvous with every engine worker: the trainer's TCPStore waits this long,
    and `VLLMWeightSender.send` waits this long for the join. At most vLLM's own store timeout
    (300 s): the engines' workers give up then whatever is set here."""
    wire_dtype: str | None = None
    """Dtype the weights travel in (the engine's, e.g. ``bfloat16``: half the bytes of fp32);
    None sends the trainer's own dtype. vLLM's ``load_weights`` casts to the engine's dtype."""

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            raise ValueError(f"VLLMSyncConfig.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.num_buffers < 1:
            raise ValueError(f"VLLMSyncConfig.num_buffers must be >= 1, got {self.num_buffers}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"VLLMSyncConfig.master_port must be in [0, 65535], got {self.master_port}")
        check_join_timeout(self.join_timeout_s, "VLLMSyncConfig.join_timeout_s")
        if self.wire_dtype is not None:
            dtype_from_name(self.wire_dtype)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 1024 * 1024)


def check_join_timeout(timeout_s: float, setting: str) -> None:
    """Refuse a rendezvous deadline vLLM's workers would not honour (they wait 300 s at most)."""
    if not 0 < timeout_s <= VLLM_STORE_TIMEOUT_S:
        raise ValueError(
            f"{setting}={timeout_s} must be in (0, {VLLM_STORE_TIMEOUT_S:g}]: vLLM 0.33's workers wait "
            f"{VLLM_STORE_TIMEOUT_S:g} s in their TCPStore rendezvous, so a longer deadline cannot hold"
        )


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
        "dtype_names": [dtype_name(m.dtype) for m in metas],
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


def model_tensor_metas(model: torch.nn.Module, wire_dtype: torch.dtype | None = None) -> list[TensorMeta]:
    """Metadata of ``model.named_parameters()`` (tied weights once, global shapes under FSDP2), with
    floating-point tensors in ``wire_dtype`` when given."""
    return [TensorMeta(name, _wire(p.dtype, wire_dtype), tuple(p.shape)) for name, p in model.named_parameters()]


def iter_full_tensors(model: torch.nn.Module, wire_dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` in ``wire_dtype`` (floating point only); an FSDP2 shard (DTensor)
    is all-gathered, so every rank must iterate."""
    for name, p in model.named_parameters():
        full = full_tensor(p).detach()
        yield name, full.to(_wire(full.dtype, wire_dtype))


def _wire(dtype: torch.dtype, wire_dtype: torch.dtype | None) -> torch.dtype:
    return wire_dtype if wire_dtype is not None and dtype.is_floating_point else dtype


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


class VLLMWeightSender:
    """The trainer's side of vLLM's NCCL weight transfer (`asyncrl.sync.base.WeightSender`).

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
        self.wire_dtype = dtype_from_name(self.config.wire_dtype) if self.config.wire_dtype else None
        self.port = 0
        self.device: torch.device | None = None
        self._comm = None
        self._join: JoinThread | None = None
        self._streams: list[object | None] = []
        self.stats = {"syncs": 0, "meta_sends": 0, "bytes_sent": 0, "peak_extra_bytes": 0, "last_send_s": 0.0}

    @classmethod
    def from_init(cls, model: torch.nn.Module, *, rank: int, init: SenderInit) -> VLLMWeightSender:
        """Build from the coordinator's `SenderInit` (``method="vllm"``): ``workers_per_engine``
        workers for each of the ``(world_size - 1) / workers_per_engine`` engines."""
        if hasattr(model, "peft_config"):
            raise ValueError("a LoRA trainer (trainer.lora.rank > 0) syncs its adapters with weight_sync.method="
                             "'broadcast' (merged in vLLM's workers); set it instead of 'vllm'")
        g, w = init.group, init.workers_per_engine
        engines, rest = divmod(g.world_size - 1, w)
        if engines < 1 or rest:
            raise ValueError(f"world_size={g.world_size} is not 1 + engines * workers_per_engine={w}")
        config = VLLMSyncConfig(
            master_address=node_address() if g.master_addr == "auto" else g.master_addr,
            master_port=g.master_port, bucket_mb=init.bucket_mb, wire_dtype=init.wire_dtype,
            join_timeout_s=g.join_timeout_s or g.timeout_s,
        )
        return cls(model, rank=rank, workers_per_engine=[w] * engines, config=config)

    @property
    def world_size(self) -> int:
        return 1 + sum(self.workers_per_engine)

    def metas(self) -> list[TensorMeta]:
        """What is sent, in order: `model_tensor_metas` of the model, in the wire dtype."""
        return model_tensor_metas(self.model, self.wire_dtype)

    # -- rendezvous ---------------------------------------------------------------------------

    def connect(self) -> list[ReceiverInit] | None:
        """Rank 0: start joining vLLM's group; return one `ReceiverInit` per engine.

        The join finishes only when every engine worker has run ``init_weight_transfer_engine``
        with its record, so it runs in a thread and `send` waits for it. Other ranks: None.
        """
        if self.rank != 0:
            return None
        self.port = self.config.master_port or free_port(self.config.master_address)
        self.device = self._device()
        self._join = self._start_join()
        return self.receiver_inits()

    def receiver_inits(self) -> list[ReceiverInit]:
        """One `ReceiverInit` per engine: vLLM's ``NCCLWeightTransferInitInfo`` fields."""
        infos = engine_init_infos(
            master_address=self.config.master_address, master_port=self.port,
            workers_per_engine=self.workers_per_engine, packed=self.config.packed,
            bucket_bytes=self.config.bucket_bytes, num_buffers=self.config.num_buffers,
        )
        group = GroupInit(master_addr=self.config.master_address, master_port=self.port, world_size=self.world_size,
                          timeout_s=self.config.join_timeout_s, join_timeout_s=self.config.join_timeout_s)
        keys = ("packed", "packed_buffer_size_bytes", "packed_num_buffers")
        return [ReceiverInit(method="vllm", group=group, rank_offset=info["rank_offset"],
                             options={k: info[k] for k in keys}) for info in infos]

    @staticmethod
    def _device() -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def _start_join(self) -> JoinThread:
        # vLLM's trainer_init waits 300 s in its TCPStore; building the same group here lets the
        # store wait exactly join_timeout_s, the deadline the config names.
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        from vllm.utils.nccl import unpinned_nccl_env

        cfg, device = self.config, self.device

        def join():
            torch.cuda.set_device(device)
            pg = StatelessProcessGroup.create(host=cfg.master_address, port=self.port, rank=0,
                                              world_size=self.world_size, store_timeout=int(cfg.join_timeout_s))
            with unpinned_nccl_env():
                return PyNcclCommunicator(pg, device=device)

        return JoinThread(join, name="vllm-weight-transfer-join", error=VLLMWeightSyncError)

    def _wait_joined(self):
        if self._comm is not None:
            return self._comm
        if self._join is None:
            raise VLLMWeightSyncError("VLLMWeightSender.send before connect(): open the NCCL endpoint first")
        cfg = self.config
        self._comm = self._join.wait(
            cfg.join_timeout_s,
            f"joining vLLM's weight-transfer group at {cfg.master_address}:{self.port} ({self.world_size} ranks; "
            "every engine must run init_weight_sync; WeightSyncConfig.connect_timeout_s)",
        )
        self._join = None
        if self.device is not None and self.device.type == "cuda":
            self._streams = [torch.cuda.Stream(device=self.device) for _ in range(cfg.num_buffers)]
        else:
            self._streams = [None] * cfg.num_buffers
        return self._comm

    # -- one sync -----------------------------------------------------------------------------

    def update_kwargs(self, *, version: int) -> dict:
        """Rank 0: the ``receive_weights`` kwargs every vLLM engine gets for this sync: the full
        names/dtypes/shapes, every time (vLLM 0.33 reads empty lists as "same as last time", but
        0.32 requires them and would load nothing)."""
        metas = self.metas()
        if self.config.packed:
            check_vllm_alignment(metas, self.config.bucket_bytes)
        self.stats["meta_sends"] += 1
        return update_info(metas)

    @torch.no_grad()
    def send(self, *, version: int) -> dict:
        """Broadcast every parameter; all trainer ranks call it while the engines run
        ``receive_weights(**update_kwargs(version=...))``. Returns stats.

        Whatever fails on rank 0 (the join, a broadcast), it still runs every gather to the end
        so the other trainer ranks never hang in a collective, then raises `VLLMWeightSyncError`.
        """
        start = time.perf_counter()
        metas = self.metas()
        pairs = iter_full_tensors(self.model, self.wire_dtype)
        if self.rank != 0:
            for _ in pairs:  # join the FSDP2 all-gathers rank 0's iteration runs
                pass
            return {**self.stats, "version": version}
        try:
            comm = self._wait_joined()
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # send may run in a thread other than connect's caller
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
            if isinstance(exc, VLLMWeightSyncError):
                raise
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
        self._join = None  # a join in progress ends at join_timeout_s
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None


class VLLMWeightReceiver:
    """The engine's side (`asyncrl.sync.base.WeightReceiver`) inside a `VLLMEngine`'s actor.

    vLLM's workers do the receiving; this drives them through the engine's ``AsyncLLM``:
    `connect` -> ``init_weight_transfer_engine``; `receive` -> ``start_weight_update``,
    ``update_weights`` (while the trainer broadcasts), then the engine's
    ``finish_weight_update(version)``. Every call runs under a deadline taken from the init
    record: the rendezvous under ``join_timeout_s`` (`WeightSyncConfig.connect_timeout_s`), each
    update step under ``timeout_s`` (``transfer_timeout_s``).

    When a step fails or runs out of time, vLLM's worker may still be inside it (blocked in the
    rendezvous or a broadcast), and its later calls would queue behind it: the engine is marked
    broken (it refuses ``resume()`` and every later weight call, naming why) and must be rebuilt.
    It never serves half-loaded weights.
    """

    def __init__(self, engine, init_info: dict, *, join_timeout_s: float, timeout_s: float) -> None:
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in init_info]
        if missing:
            raise ValueError(f"vLLM init info is missing {missing}: pass this engine's ReceiverInit")
        check_join_timeout(join_timeout_s, "join_timeout_s (WeightSyncConfig.connect_timeout_s)")
        self.engine = engine
        self.init_info = dict(init_info)
        self.join_timeout_s = join_timeout_s
        self.timeout_s = timeout_s

    @classmethod
    def from_init(cls, engine, init: ReceiverInit) -> VLLMWeightReceiver:
        g = init.group
        info = {"master_address": g.master_addr, "master_port": g.master_port, "rank_offset": init.rank_offset,
                "world_size": g.world_size, **init.options}
        return cls(engine, info, join_timeout_s=g.join_timeout_s or g.timeout_s, timeout_s=g.timeout_s)

    async def connect(self) -> None:
        """Join the trainer's NCCL group; returns when the trainer has joined too."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._check_usable("init_weight_sync")
        info = dict(self.init_info)
        if _vllm_series() < (0, 33) and info.get("packed_num_buffers", 1) > 1:
            # vLLM 0.32's packed receiver may unpack a tensor split over two buckets before the
            # second bucket landed when it cycles several buffers (0.33 orders them with events)
            info["packed_num_buffers"] = 1
        request = WeightTransferInitRequest(init_info=info)
        await self._step(self.engine.llm.init_weight_transfer_engine(request), "init_weight_transfer_engine",
                         self.join_timeout_s, "connect_timeout_s")

    async def receive(self, *, version: int, names: Sequence[str] = (), dtype_names: Sequence[str] = (),
                      shapes: Sequence[Sequence[int]] = ()) -> None:
        """Receive one full set of weights while paused, as the trainer's ``send`` broadcasts it,
        and commit it as ``version``. Empty lists reuse the metadata of the last update."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        engine = self.engine
        if engine.paused is None:
            raise VLLMWeightSyncError("receive_weights while serving: pause(mode='keep') first")
        self._check_usable("receive_weights")
        if not len(names) == len(dtype_names) == len(shapes):
            raise ValueError(
                f"receive_weights: names, dtype_names and shapes differ in length "
                f"({len(names)}, {len(dtype_names)}, {len(shapes)})"
            )
        info = {"names": list(names), "dtype_names": list(dtype_names), "shapes": [list(x) for x in shapes]}
        # Until finish_weight_update succeeds the model may hold a mix of old and new tensors.
        engine.weights_broken = "a weight update started and did not finish; rebuild the engine"
        await self._step(engine.llm.start_weight_update(), "start_weight_update", self.timeout_s, "transfer_timeout_s")
        engine.weight_update_open = True
        await self._step(engine.llm.update_weights(WeightTransferUpdateRequest(update_info=info)), "update_weights",
                         self.timeout_s, "transfer_timeout_s")
        await self._step(engine.finish_weight_update(version), "finish_weight_update", self.timeout_s,
                         "transfer_timeout_s")

    def close(self) -> None:
        """Nothing to release here: vLLM's worker owns the group (it lives as long as the engine)."""

    def _check_usable(self, what: str) -> None:
        self.engine.check_open()
        if self.engine.weights_broken is not None:
            # vLLM's worker may still be inside the failed step (e.g. blocked in NCCL): fail fast.
            raise VLLMWeightSyncError(f"{what}: {self.engine.weights_broken}")

    async def _step(self, awaitable, what: str, timeout_s: float, setting: str):
        try:
            return await asyncio.wait_for(awaitable, timeout_s)
        except TimeoutError:
            self.engine.weights_broken = (f"vLLM {what} did not finish within WeightSyncConfig.{setting}={timeout_s}s; "
                                          "its worker may still be inside it: rebuild the engine")
            raise VLLMWeightSyncError(self.engine.weights_broken) from None
        except VLLMWeightSyncError:
            raise
        except Exception as exc:
            self.engine.weights_broken = f"vLLM {what} failed ({exc}); rebuild the engine"
            raise VLLMWeightSyncError(self.engine.weights_broken) from exc


def _vllm_series() -> tuple[int, int]:
    """(major, minor) of the installed vLLM."""
    from vllm import __version__

    major, minor = __version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
