"""The trainer's half of the ``vllm`` backend: every trainer rank gathers, rank 0 joins vLLM's group and broadcasts."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import torch

from asyncrl.net import free_port
from asyncrl.sync.base import GroupInit, JoinThread, ReceiverInit, SenderInit, node_address
from asyncrl.sync.vllm.config import VLLMSyncConfig
from asyncrl.sync.vllm.protocol import (
    TensorMeta,
    broadcast_packed,
    check_vllm_alignment,
    engine_init_infos,
    iter_full_tensors,
    model_tensor_metas,
    next_checked,
    update_info,
)
from asyncrl.sync.wire import VLLMWeightSyncError, dtype_from_name


class VLLMWeightSender:
    """The trainer's side of vLLM's NCCL weight transfer (`asyncrl.sync.base.WeightSender`).

    Built on every trainer rank around the (possibly FSDP2-sharded) model; every rank calls
    `send` (the all-gathers are collectives), only rank 0 opens the NCCL endpoint and
    broadcasts. See the package docstring (`asyncrl.sync.vllm`) for the order of calls.
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
            _, tensor = next_checked(pairs, metas, i)
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
