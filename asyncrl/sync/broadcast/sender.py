"""The trainer's half of the ``broadcast`` backend (the wire protocol: `asyncrl.sync.broadcast`).

Sender. Every trainer rank calls `send`: gathering full tensors from FSDP2 shards
(``DTensor.full_tensor()``) is a collective on the training world, done bucket by bucket
in the same order on every rank (on a 1-rank mesh the local tensor is the full one: no
gather). Only rank 0 joins the weight-sync group and broadcasts.

Two bucket buffers alternate: bucket ``i + 1`` is gathered and packed while bucket ``i``
is on the wire. A bucket holding a single tensor (one that does not fit beside its
neighbours in ``bucket_mb``) is byte-identical to that tensor, so it is sent from the
tensor's own memory, unpacked (and a receiver whose engine has ``weight_views`` receives it
straight into the parameter). Only buckets of several tensors are packed, so the buffers
are sized by the largest packed bucket: rank 0's extra memory is at most two buffers of
``bucket_mb`` (kept between syncs unless ``keep_buffers=False``) plus two buckets of
gathered full tensors in flight (none for an unsharded model).

If the broadcast fails (a receiver died), rank 0 drops the group and every pending Work
(destroying the gloo group is what closes its sockets), so the other receivers fail fast
instead of waiting out the timeout, but keeps gathering to the end so the other trainer
ranks never hang in a collective; then it raises `WeightSyncError`.
Leaves out: streams/events for GPU overlap beyond what the backend's async work gives.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from asyncrl.sync.base import GroupInit, JoinThread, ReceiverInit, SenderInit, full_tensor, local_tensor, node_address
from asyncrl.sync.broadcast.header import encode_header
from asyncrl.sync.buckets import NUM_BUFFERS, BucketBuffers, BucketLayout, model_param_metas, pack, plan_buckets
from asyncrl.sync.group import WeightSyncGroup
from asyncrl.sync.wire import WeightSyncError
from asyncrl.sync.lora_wire import adapter_params, is_lora
from asyncrl.sync.lora_wire import spec as lora_spec


def _abandon(group: WeightSyncGroup, inflight: list) -> None:
    # Drop every pending Work first: they (and a traceback holding this list) keep the backend
    # group alive, and only its destruction closes the sockets so the receivers fail fast.
    inflight[:] = [None] * len(inflight)
    group.close()


class BroadcastSender:
    """Send a model's parameters to every engine of the weight-sync group (see module doc)."""

    def __init__(self, model: torch.nn.Module, *, rank: int, bucket_mb: float = 4.0, keep_buffers: bool = True,
                 workers_per_engine: int = 1, **group) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if workers_per_engine < 1:
            raise ValueError(f"workers_per_engine must be >= 1, got {workers_per_engine}")
        self.workers_per_engine = workers_per_engine
        """Group ranks each engine takes (a vLLM engine's tensor-parallel workers each receive)."""
        self.model = model
        self.rank = rank
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.keep_buffers = keep_buffers
        """Keep the two bucket buffers between syncs (no page faults next time; 2 buckets stay resident)."""
        self._bufs: BucketBuffers | None = None
        self.group_config = GroupInit(**group)
        self._group: WeightSyncGroup | None = None
        self._join: JoinThread | None = None
        self._layout: BucketLayout | None = None
        self._sent_fingerprint: str | None = None
        self.stats = {"syncs": 0, "meta_sends": 0, "bytes_sent": 0, "peak_extra_bytes": 0, "last_send_s": 0.0}
        self.lora = lora_spec(model) if is_lora(model) else None
        """A LoRA model's adapter spec (`asyncrl.trainer.lora.spec`): only its adapters travel."""

    @classmethod
    def from_init(cls, model: torch.nn.Module, *, rank: int, init: SenderInit) -> BroadcastSender:
        """Build from the coordinator's `SenderInit` (``method="broadcast"``)."""
        g = init.group
        return cls(model, rank=rank, bucket_mb=init.bucket_mb, workers_per_engine=init.workers_per_engine,
                   master_addr=g.master_addr, master_port=g.master_port, world_size=g.world_size,
                   backend=g.backend, timeout_s=g.timeout_s, group_name=g.group_name)

    # -- rendezvous ---------------------------------------------------------------------------

    def connect(self) -> list[ReceiverInit] | None:
        """Rank 0: host the store, start joining the group, return one `ReceiverInit` per engine.

        The join completes when every engine worker joined (they need the port this returns,
        so it cannot block here); `send` waits for it. Other ranks: nothing to do, None.
        """
        if self.rank != 0:
            return None
        if self.group_config.master_addr == "auto":
            self.group_config = replace(self.group_config, master_addr=node_address())
        self._group = WeightSyncGroup(self.group_config, rank=0)
        port = self._group.listen()
        self._join = JoinThread(self._group.join, name="weight-sync-join")
        group = replace(self.group_config, master_port=port)
        wpe = self.workers_per_engine
        if (group.world_size - 1) % wpe:
            raise WeightSyncError(f"world_size {group.world_size} is not 1 + a multiple of workers_per_engine={wpe}")
        options = {"lora": self.lora} if self.lora is not None else {}
        return [ReceiverInit(method="broadcast", group=group, rank_offset=r, options=options)
                for r in range(1, group.world_size, wpe)]

    def update_kwargs(self, *, version: int) -> dict:
        """Nothing beyond the version: the layout travels in-band (header + metadata)."""
        return {}

    def _wait_joined(self) -> WeightSyncGroup:
        if self._group is None:
            raise WeightSyncError("weight sender is not connected: call connect() first")
        if self._join is not None:
            self._join.wait(self.group_config.timeout_s, "joining the weight-sync group (every engine must join)")
            self._join = None
        return self._group

    # -- send ---------------------------------------------------------------------------------

    def _params(self) -> dict[str, torch.Tensor]:
        """What a sync carries, by wire name: every parameter, or a LoRA model's adapters only."""
        if self.lora is not None:
            return adapter_params(self.model)
        return dict(self.model.named_parameters())

    def layout(self) -> BucketLayout:
        """The bucket layout of the model now (cached while names/dtypes/shapes do not change)."""
        if self.lora is not None:
            metas, aliases = [(n, p.dtype, tuple(p.shape)) for n, p in adapter_params(self.model).items()], []
        else:
            metas, aliases = model_param_metas(self.model)
        layout = plan_buckets(metas, self.bucket_bytes, aliases)
        if self._layout is None or layout.fingerprint() != self._layout.fingerprint():
            self._layout = layout
        return self._layout

    @torch.no_grad()
    def send(self, *, version: int) -> dict:
        """Broadcast every parameter as ``version``; all trainer ranks call it. Returns stats."""
        start = time.perf_counter()
        layout = self.layout()
        params = self._params()
        group: WeightSyncGroup | None = None
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                group = self._wait_joined()
                self._send_header(group, layout, version)
            except Exception as exc:  # noqa: BLE001 - keep gathering (other ranks wait on us), raise at the end
                failure = exc
                if group is not None:
                    group.close()
        bufs = self._buffers(group)
        run = {"gather_s": 0.0, "pack_s": 0.0, "wire_wait_s": 0.0, "timeline": []}
        late, peak = self._send_buckets(layout, params, group if failure is None else None, bufs, run)
        failure = failure if failure is not None else late
        if not self.keep_buffers and bufs is not None:
            bufs.release()
        if failure is not None:
            self._sent_fingerprint = None
            raise WeightSyncError(f"broadcast of weights version {version} failed: {failure}") from failure
        elapsed = time.perf_counter() - start
        self.stats["syncs"] += 1
        self.stats["bytes_sent"] += layout.total_bytes if self.rank == 0 else 0
        self.stats["peak_extra_bytes"] = max(self.stats["peak_extra_bytes"], peak)
        self.stats["last_send_s"] = elapsed
        self.stats.update(run)
        return {**self.stats, "version": version, "buckets": len(layout.buckets), "bytes": layout.total_bytes}

    def _send_buckets(self, layout: BucketLayout, params: dict[str, torch.Tensor], group: WeightSyncGroup | None,
                      bufs: BucketBuffers | None, run: dict) -> tuple[Exception | None, int]:
        """Gather every bucket (a collective on every trainer rank) and, given a ``group`` (rank 0, header
        sent), broadcast it, two buckets in flight. After a failure the group is dropped and the rest only
        gathered. Adds timings and the per-bucket timeline to ``run``; returns (failure, peak extra bytes)."""
        inflight: list[tuple | None] = [None] * NUM_BUFFERS  # per slot: (work, tensors kept alive, their bytes)
        failure: Exception | None = None
        peak = 0
        for i, bucket in enumerate(layout.buckets):
            t = time.perf_counter()
            tensors = [full_tensor(params[s.name]) for s in bucket.slots]
            run["gather_s"] += time.perf_counter() - t
            if group is None or failure is not None:
                continue
            # full tensors gathered from shards are new memory; a local tensor costs nothing
            gathered = sum(t.nbytes for s, t in zip(bucket.slots, tensors) if t.data_ptr() != local_tensor(params[s.name]).data_ptr())
            try:
                slot = i % NUM_BUFFERS
                self._drain(inflight, slot, run)
                # no local name may hold a Work: it would keep a failed group's sockets open (_abandon)
                on_wire = self._on_wire(inflight, (i - 1) % NUM_BUFFERS)
                t = time.perf_counter()
                payload, keep = self._payload(bucket, tensors, lambda: bufs.get(slot, bucket.nbytes), run)
                # per bucket: (packed, pack start, posted, previous bucket still on the wire)
                run["timeline"].append((keep is None, t, time.perf_counter(), on_wire))
                inflight[slot] = (group.broadcast(payload), keep, gathered if keep else 0)
                peak = max(peak, bufs.nbytes + gathered + sum(x[2] for x in inflight if x))
            except Exception as exc:  # noqa: BLE001 - keep gathering, raise at the end
                failure = exc
                _abandon(group, inflight)
            del tensors
        if group is not None and failure is None:
            try:
                for slot in range(NUM_BUFFERS):
                    self._drain(inflight, slot, run)
            except Exception as exc:  # noqa: BLE001
                failure = exc
                _abandon(group, inflight)
        del inflight  # a traceback of ``failure`` keeps this frame: it must not keep a Work
        return failure, peak

    @staticmethod
    def _on_wire(inflight: list, slot: int) -> bool:
        return inflight[slot] is not None and not inflight[slot][0].is_completed()

    @staticmethod
    def _drain(inflight: list, slot: int, timing: dict) -> None:
        t = time.perf_counter()
        if inflight[slot] is not None:
            inflight[slot][0].wait()
            inflight[slot] = None
        timing["wire_wait_s"] += time.perf_counter() - t

    @staticmethod
    def _payload(bucket, tensors: list[torch.Tensor], buffer, timing: dict):
        """(uint8 tensor to broadcast, tensors to keep alive until it is sent)."""
        if len(tensors) == 1 and tensors[0].is_contiguous():
            # a bucket of one tensor is byte-identical to the tensor: send it from its own memory
            return tensors[0].reshape(-1).view(torch.uint8), tensors
        t = time.perf_counter()
        packed = pack(bucket, tensors, buffer())
        timing["pack_s"] += time.perf_counter() - t
        return packed, None

    def _buffers(self, group: WeightSyncGroup | None) -> BucketBuffers | None:
        if group is None:
            return None
        if self._bufs is None or self._bufs.device != group.device:
            self._bufs = BucketBuffers(group.device)
        return self._bufs

    def _send_header(self, group: WeightSyncGroup, layout: BucketLayout, version: int) -> None:
        meta = b""
        if self._sent_fingerprint != layout.fingerprint():
            meta = layout.encode()
        header = encode_header(version, len(meta), len(layout.buckets))
        group.broadcast(header.to(group.device)).wait()
        if meta:
            payload = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(group.device)
            group.broadcast(payload).wait()
            self._sent_fingerprint = layout.fingerprint()
            self.stats["meta_sends"] += 1

    def close(self) -> None:
        """Leave the group (rank 0); safe to call twice; does not wait for engines still joining."""
        self._join = None  # a join in progress ends at timeout_s, then sees the group closed
        if self._group is not None:
            self._group.close()
            self._group = None
        if self._bufs is not None:
            self._bufs.release()
