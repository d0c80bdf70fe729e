"""`WeightSender`: the trainer side of a weight sync, used inside every trainer rank.

Every trainer rank calls `send`: gathering full tensors from FSDP2 shards
(``DTensor.full_tensor()``) is a collective on the training world, done bucket by bucket
in the same order on every rank (on a 1-rank mesh the local tensor is the full one: no
gather). Only rank 0 joins the weight-sync group and broadcasts.

Wire protocol on the group, per sync (all from rank 0):

1. header: int64 ``[MAGIC, version, meta_nbytes, num_buckets]``;
2. if ``meta_nbytes > 0``: the msgpack `BucketLayout` as uint8 (sent on the first sync of
   a group and whenever names/dtypes/shapes/bucket size change, otherwise 0);
3. one uint8 tensor per bucket, laid out as `asyncrl.sync.buckets` says.

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

import threading
import time
from dataclasses import asdict, replace

import torch

from asyncrl.sync.buckets import NUM_BUFFERS, BucketBuffers, BucketLayout, model_param_metas, pack, plan_buckets
from asyncrl.sync.group import SyncGroupConfig, WeightSyncGroup

MAGIC = 0x57535943  # "WSYC"
HEADER_LEN = 4


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message names the member, the step and the setting involved."""


def _full(p: torch.Tensor) -> torch.Tensor:
    # FSDP2 parameters are DTensors: full_tensor() all-gathers the shards (a collective).
    if not hasattr(p, "full_tensor"):
        return p
    if p.device_mesh.size() == 1:
        # one rank holds everything: its local tensor is the full one, no gather, no copy
        local = p.to_local()
        if local.shape == p.shape:
            return local
    return p.full_tensor()


def _node_address() -> str:
    # "auto": this node's address as Ray knows it (reachable from engines on other nodes)
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _abandon(group: WeightSyncGroup, inflight: list) -> None:
    # Drop every pending Work first: they (and a traceback holding this list) keep the backend
    # group alive, and only its destruction closes the sockets so the receivers fail fast.
    inflight[:] = [None] * len(inflight)
    group.close()


class WeightSender:
    """Send a model's parameters to every engine of the weight-sync group (see module doc)."""

    def __init__(self, model: torch.nn.Module, *, rank: int, bucket_mb: float = 4.0, keep_buffers: bool = True,
                 **group) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.model = model
        self.rank = rank
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.keep_buffers = keep_buffers
        """Keep the two bucket buffers between syncs (no page faults next time; 2 buckets stay resident)."""
        self._bufs: BucketBuffers | None = None
        self.group_config = SyncGroupConfig(**group)
        self._group: WeightSyncGroup | None = None
        self._join_thread: threading.Thread | None = None
        self._join_error: BaseException | None = None
        self._layout: BucketLayout | None = None
        self._sent_fingerprint: str | None = None
        self.stats = {"syncs": 0, "meta_sends": 0, "bytes_sent": 0, "peak_extra_bytes": 0, "last_send_s": 0.0}

    # -- rendezvous ---------------------------------------------------------------------------

    def connect(self) -> dict | None:
        """Rank 0: host the store, start joining the group, return ``{master_addr, master_port}``.

        The join completes when every engine worker joined (they need the port this returns,
        so it cannot block here); `send` waits for it. Other ranks: nothing to do, None.
        """
        if self.rank != 0:
            return None
        if self.group_config.master_addr == "auto":
            self.group_config = replace(self.group_config, master_addr=_node_address())
        self._group = WeightSyncGroup(self.group_config, rank=0)
        port = self._group.listen()
        self._join_thread = threading.Thread(target=self._join, name="weight-sync-join", daemon=True)
        self._join_thread.start()
        return {"master_addr": self.group_config.master_addr, "master_port": port}

    def _join(self) -> None:
        try:
            self._group.join()
        except BaseException as exc:  # noqa: BLE001 - forwarded to send()
            self._join_error = exc

    def _wait_joined(self) -> WeightSyncGroup:
        if self._group is None:
            raise WeightSyncError("weight sender is not connected: call connect() first")
        if self._join_thread is not None:
            self._join_thread.join(self.group_config.timeout_s)
            if self._join_thread.is_alive():
                raise WeightSyncError(
                    f"engines did not join the weight-sync group within timeout_s={self.group_config.timeout_s}s"
                )
            self._join_thread = None
        if self._join_error is not None:
            raise WeightSyncError(f"joining the weight-sync group failed: {self._join_error}") from self._join_error
        return self._group

    # -- send ---------------------------------------------------------------------------------

    def layout(self) -> BucketLayout:
        """The bucket layout of the model now (cached while names/dtypes/shapes do not change)."""
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
        params = dict(self.model.named_parameters())
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
        inflight: list[tuple | None] = [None] * NUM_BUFFERS  # per slot: (work, tensors kept alive, their bytes)
        peak = 0
        timing = {"gather_s": 0.0, "pack_s": 0.0, "wire_wait_s": 0.0}
        for i, bucket in enumerate(layout.buckets):
            t = time.perf_counter()
            tensors = [_full(params[s.name]) for s in bucket.slots]
            timing["gather_s"] += time.perf_counter() - t
            if group is None or failure is not None:
                continue
            # full tensors gathered from shards are new memory; a local tensor costs nothing
            gathered = sum(t.nbytes for s, t in zip(bucket.slots, tensors) if t.data_ptr() != _local(params[s.name]).data_ptr())
            try:
                slot = i % NUM_BUFFERS
                self._drain(inflight, slot, timing)
                payload, keep = self._payload(bucket, tensors, lambda: bufs.get(slot, bucket.nbytes), timing)
                inflight[slot] = (group.broadcast(payload), keep, gathered if keep else 0)
                peak = max(peak, bufs.nbytes + gathered + sum(x[2] for x in inflight if x))
            except Exception as exc:  # noqa: BLE001 - keep gathering, raise at the end
                failure = exc
                _abandon(group, inflight)
            del tensors
        if group is not None and failure is None:
            try:
                for slot in range(NUM_BUFFERS):
                    self._drain(inflight, slot, timing)
            except Exception as exc:  # noqa: BLE001
                failure = exc
                _abandon(group, inflight)
        del inflight
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
        self.stats.update(timing)
        return {**self.stats, "version": version, "buckets": len(layout.buckets), "bytes": layout.total_bytes}

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
        header = torch.tensor([MAGIC, version, len(meta), len(layout.buckets)], dtype=torch.int64)
        group.broadcast(header.to(group.device)).wait()
        if meta:
            payload = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(group.device)
            group.broadcast(payload).wait()
            self._sent_fingerprint = layout.fingerprint()
            self.stats["meta_sends"] += 1

    def close(self) -> None:
        """Leave the group (rank 0); safe to call twice; does not wait for engines still joining."""
        self._join_thread = None  # a join in progress ends at timeout_s, then sees the group closed
        if self._group is not None:
            self._group.close()
            self._group = None
        if self._bufs is not None:
            self._bufs.release()

    def describe(self) -> dict:
        """Plain-value summary (for logs): group settings and bucket size."""
        return {**asdict(self.group_config), "bucket_bytes": self.bucket_bytes, "rank": self.rank}

