"""`WeightSender`: the trainer side of a weight sync, used inside every trainer rank.

Every trainer rank calls `send`: gathering full tensors from FSDP2 shards
(``DTensor.full_tensor()``) is a collective on the training world, done bucket by bucket
in the same order on every rank. Only rank 0 joins the weight-sync group and broadcasts.

Wire protocol on the group, per sync (all from rank 0):

1. header: int64 ``[MAGIC, version, meta_nbytes, num_buckets]``;
2. if ``meta_nbytes > 0``: the msgpack `BucketLayout` as uint8 (sent on the first sync of
   a group and whenever names/dtypes/shapes/bucket size change, otherwise 0);
3. one packed uint8 tensor per bucket.

Two bucket buffers alternate: bucket ``i + 1`` is gathered and packed while bucket ``i``
is on the wire. So rank 0's extra memory is two buffers of ``max(bucket_mb, largest
tensor)`` plus one bucket of gathered full tensors (none for an unsharded model).

If the broadcast fails (a receiver died), rank 0 aborts the group, so the other receivers
fail fast instead of waiting out the timeout, but keeps gathering to the end so the other
trainer ranks never hang in a collective; then it raises `WeightSyncError`.
Leaves out: streams/events for GPU overlap beyond what the backend's async work gives.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict

import torch

from asyncrl.sync.buckets import BucketLayout, model_param_metas, pack, plan_buckets
from asyncrl.sync.group import SyncGroupConfig, WeightSyncGroup

MAGIC = 0x57535943  # "WSYC"
HEADER_LEN = 4


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message names the member, the step and the setting involved."""


def _full(p: torch.Tensor) -> torch.Tensor:
    # FSDP2 parameters are DTensors: full_tensor() all-gathers the shards (a collective).
    if hasattr(p, "full_tensor"):
        return p.full_tensor()
    return p


class WeightSender:
    """Send a model's parameters to every engine of the weight-sync group (see module doc)."""

    def __init__(self, model: torch.nn.Module, *, rank: int, bucket_mb: float = 64.0, **group) -> None:
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.model = model
        self.rank = rank
        self.bucket_bytes = int(bucket_mb * 2**20)
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
        group = self._wait_joined() if self.rank == 0 else None
        params = dict(self.model.named_parameters())
        failure: BaseException | None = None
        if group is not None:
            try:
                self._send_header(group, layout, version)
            except Exception as exc:  # noqa: BLE001 - keep gathering, raise at the end
                failure = exc
                group.close()
        bufs: list[torch.Tensor] = []
        pending: list = [None, None]
        peak = 0
        for i, bucket in enumerate(layout.buckets):
            tensors = [_full(params[s.name]) for s in bucket.slots]
            if group is None or failure is not None:
                continue
            # full tensors gathered from shards are new memory; a local parameter is packed in place
            gathered = sum(t.nbytes for s, t in zip(bucket.slots, tensors) if hasattr(params[s.name], "full_tensor"))
            try:
                slot = i % 2
                if pending[slot] is not None:
                    pending[slot].wait()
                    pending[slot] = None
                if len(bufs) <= slot:
                    bufs.append(torch.empty(layout.max_bucket_bytes, dtype=torch.uint8, device=group.device))
                peak = max(peak, sum(b.nbytes for b in bufs) + gathered)
                packed = pack(bucket, tensors, bufs[slot])
                if packed.is_cuda:
                    torch.cuda.current_stream().synchronize()
                pending[slot] = group.broadcast(packed)
            except Exception as exc:  # noqa: BLE001 - keep gathering, raise at the end
                failure = exc
                group.close()
            del tensors
        if group is not None and failure is None:
            try:
                for work in pending:
                    if work is not None:
                        work.wait()
            except Exception as exc:  # noqa: BLE001
                failure = exc
                group.close()
        del bufs, pending
        if failure is not None:
            self._sent_fingerprint = None
            raise WeightSyncError(f"broadcast of weights version {version} failed: {failure}") from failure
        elapsed = time.perf_counter() - start
        self.stats["syncs"] += 1
        self.stats["bytes_sent"] += layout.total_bytes if self.rank == 0 else 0
        self.stats["peak_extra_bytes"] = max(self.stats["peak_extra_bytes"], peak)
        self.stats["last_send_s"] = elapsed
        return {**self.stats, "version": version, "buckets": len(layout.buckets), "bytes": layout.total_bytes}

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
        """Leave the group (rank 0); safe to call twice."""
        if self._join_thread is not None:
            self._join_thread.join(self.group_config.timeout_s)
            self._join_thread = None
        if self._group is not None:
            self._group.close()
            self._group = None

    def describe(self) -> dict:
        """Plain-value summary (for logs): group settings and bucket size."""
        return {**asdict(self.group_config), "bucket_bytes": self.bucket_bytes, "rank": self.rank}

