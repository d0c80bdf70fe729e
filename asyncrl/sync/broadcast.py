"""The ``broadcast`` backend: asyncrl's own weight-sync group, both halves.

`BroadcastSender` runs in every trainer rank, `BroadcastReceiver` in an engine actor; they
meet in a `asyncrl.sync.group.WeightSyncGroup` and move buckets laid out by
`asyncrl.sync.buckets`. `asyncrl.sync.backends.make_sender` / ``make_receiver`` build them from
the coordinator's `SenderInit` / `ReceiverInit`.

Sender. Every trainer rank calls `send`: gathering full tensors from FSDP2 shards
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

LoRA (``trainer.lora.rank`` > 0): the sender carries only the adapters, in the same buckets
and protocol, and tells the receivers their spec in ``ReceiverInit.options["lora"]``; a
receiver then loads into a `asyncrl.sync.lora.LoraMerger` around its engine, which merges them
onto its kept copy of the base weights when the sync completes.

Receiver. `connect` joins the weight-sync group as rank ``rank_offset``; `receive` takes one sync off
the group (header, metadata when it changed, then the buckets; see the sender above).

Where each bucket lands:

- direct: a bucket that holds one tensor is byte-identical to it, so when the engine has
  the optional ``weight_views()`` hook (see `asyncrl.rollouter.engines.base`) and that tensor's
  engine parameter is contiguous with the same dtype, shape and device, the broadcast is
  received straight into the parameter's storage: no staging buffer, no copy. An alias the
  engine keeps in separate storage (untied) is then copied from it via ``load_weights``;
- staged: every other bucket (several small tensors packed, or no hook, e.g. vLLM) is
  received into one of two alternating buffers and handed to ``engine.load_weights`` as
  views into it (the engine copies them, as the `RolloutEngine` contract says), while the
  next bucket is already being received into the other buffer.

Blocking collectives run in a worker thread under the group's ``timeout_s``, so the
actor's event loop keeps serving (e.g. ``version()`` pings) while weights travel; every
wait (join, header, metadata, each bucket) has that deadline.

Never a mix of old and new weights served: the caller (the coordinator) pauses the engine
with ``keep`` before `receive` and resumes it only after `receive` returned, so nothing
generates while buckets land, whether they are written in place by the broadcast or by
``load_weights`` (both only touch the parameters while paused; ``weight_views`` refuses
an unpaused engine). ``finish_weight_update(version)`` (the version bump) is called only
after every bucket of the layout landed. If a receive fails half way, `receive` raises,
the group is dropped, ``finish_weight_update`` is not called, ``incomplete`` stays True,
and the coordinator does not resume that engine: it stays paused until a later complete
receive (the coordinator re-sends the whole set). Metadata is received once per group and
re-used while the sender says it did not change.
An engine with several workers (vLLM with tensor parallelism) takes ``workers_per_engine``
consecutive ranks: each worker is a receiver of its own (`asyncrl.sync.vllm_broadcast`).
Leaves out: receiving packed buckets
of several tensors in place (they are staged and copied once).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import torch

from asyncrl.sync.base import GroupInit, JoinThread, ReceiverInit, SenderInit, full_tensor, local_tensor, node_address
from asyncrl.sync.buckets import NUM_BUFFERS, BucketBuffers, BucketLayout, model_param_metas, pack, plan_buckets, unpack
from asyncrl.sync.group import WeightSyncGroup
from asyncrl.sync.lora import LoraMerger
from asyncrl.sync.wire import HEADER_LEN, MAGIC, WeightSyncError, dtype_name
from asyncrl.trainer.lora import adapter_params, is_lora
from asyncrl.trainer.lora import spec as lora_spec


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
        inflight: list[tuple | None] = [None] * NUM_BUFFERS  # per slot: (work, tensors kept alive, their bytes)
        peak = 0
        timing = {"gather_s": 0.0, "pack_s": 0.0, "wire_wait_s": 0.0}
        timeline: list[tuple] = []
        for i, bucket in enumerate(layout.buckets):
            t = time.perf_counter()
            tensors = [full_tensor(params[s.name]) for s in bucket.slots]
            timing["gather_s"] += time.perf_counter() - t
            if group is None or failure is not None:
                continue
            # full tensors gathered from shards are new memory; a local tensor costs nothing
            gathered = sum(t.nbytes for s, t in zip(bucket.slots, tensors) if t.data_ptr() != local_tensor(params[s.name]).data_ptr())
            try:
                slot = i % NUM_BUFFERS
                self._drain(inflight, slot, timing)
                # no local name may hold a Work: it would keep a failed group's sockets open (_abandon)
                on_wire = self._on_wire(inflight, (i - 1) % NUM_BUFFERS)
                t = time.perf_counter()
                payload, keep = self._payload(bucket, tensors, lambda: bufs.get(slot, bucket.nbytes), timing)
                # per bucket: (packed, pack start, posted, previous bucket still on the wire)
                timeline.append((keep is None, t, time.perf_counter(), on_wire))
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
        self.stats.update(timing, timeline=timeline)
        return {**self.stats, "version": version, "buckets": len(layout.buckets), "bytes": layout.total_bytes}

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
        header = torch.tensor([MAGIC, version, len(meta), len(layout.buckets)], dtype=torch.int64)
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




class BroadcastReceiver:
    """Receive weights from trainer rank 0 into one engine (see module doc)."""

    def __init__(self, engine, *, rank_offset: int, direct: bool = True, lora: dict | None = None, **group) -> None:
        if lora is not None:
            # adapters arrive; the merger turns them into weights on an exact copy of the base
            engine = LoraMerger(engine, lora, engine.config.model_path)
        self.engine = engine
        self.direct = direct
        """Receive single-tensor buckets straight into the engine's parameters when it has
        the ``weight_views`` hook (False: always stage and ``load_weights``)."""
        self._views: dict[str, torch.Tensor] = {}
        self.rank = rank_offset
        self.group_config = GroupInit(**group)
        self._group = WeightSyncGroup(self.group_config, rank=rank_offset)
        self._layout: BucketLayout | None = None
        self._plan: dict | None = None
        self._bufs = BucketBuffers(self._group.device)
        self.incomplete = False
        """True from the first loaded bucket of a sync until its ``finish_weight_update``."""
        self.stats = {"syncs": 0, "meta_received": 0, "bytes_received": 0, "last_receive_s": 0.0}

    @classmethod
    def from_init(cls, engine, init: ReceiverInit) -> BroadcastReceiver:
        """Build from this engine's `ReceiverInit` (rank 0's answer, ``method="broadcast"``)."""
        g = init.group
        return cls(engine, rank_offset=init.rank_offset, master_addr=g.master_addr, master_port=g.master_port,
                   world_size=g.world_size, backend=g.backend, timeout_s=g.timeout_s, group_name=g.group_name,
                   **init.options)

    async def connect(self) -> dict:
        """Join the group (blocks, in a thread, until every rank joined or ``timeout_s``)."""
        await self._in_thread(self._group.join, "joining the weight-sync group")
        return {"rank": self.rank, "world_size": self.group_config.world_size, "backend": self._group.backend}

    async def receive(self, *, version: int) -> dict:
        """Receive one full set of weights and make it live as ``version``. Returns stats."""
        start = time.perf_counter()
        try:
            result = await self._receive(version)
        except BaseException:
            self._group.close()  # a half-received stream cannot be resumed: the group is rebuilt
            raise
        self.stats["syncs"] += 1
        self.stats["bytes_received"] += result["bytes"]
        self.stats["last_receive_s"] = time.perf_counter() - start
        return {**self.stats, **result}

    async def _receive(self, version: int) -> dict:
        group = self._group
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=group.device)
        await self._wait(group.broadcast(header), "receiving the sync header")
        magic, sent_version, meta_nbytes, num_buckets = (int(x) for x in header.cpu())
        if magic != MAGIC:
            raise WeightSyncError(f"rank {self.rank}: bad sync header magic {magic:#x}; sender and receiver disagree")
        if sent_version != version:
            raise WeightSyncError(f"rank {self.rank}: trainer sends version {sent_version}, coordinator asked for {version}")
        if meta_nbytes:
            payload = torch.empty(meta_nbytes, dtype=torch.uint8, device=group.device)
            await self._wait(group.broadcast(payload), "receiving the sync metadata")
            self._layout = BucketLayout.decode(payload.cpu().numpy().tobytes())
            self._plan = self._check_layout(self._layout)
            self.stats["meta_received"] += 1
        if self._layout is None:
            raise WeightSyncError(f"rank {self.rank}: no metadata received in this group yet; the sender must send it")
        layout = self._layout
        if num_buckets != len(layout.buckets):
            raise WeightSyncError(f"rank {self.rank}: header says {num_buckets} buckets, layout has {len(layout.buckets)}")

        direct = self._direct_targets(layout, group.device)
        staged = [b.nbytes for b in layout.buckets if b.index not in direct]
        depth = min(NUM_BUFFERS, num_buckets)
        bufs = [self._bufs.get(slot, max(staged)) for slot in range(depth)] if staged else []

        def post(k: int):
            dst = direct[k] if k in direct else bufs[k % depth][: layout.buckets[k].nbytes]
            return group.broadcast(dst)

        works: dict = {}
        try:
            for k in range(max(1, depth - 1) if num_buckets else 0):
                works[k] = post(k)
            self.incomplete = True
            wire = load = 0.0
            posted = {k: time.perf_counter() for k in works}
            timeline = []
            for i, bucket in enumerate(layout.buckets):
                ahead = i + depth - 1
                if ahead > i and ahead < num_buckets:
                    # Post the next receive before waiting for this one (its buffer held bucket
                    # i - 1, loaded already): `depth` receives stay posted, so the wire never
                    # idles while this thread wakes up from bucket i and while bucket i loads.
                    works[ahead] = post(ahead)
                    posted[ahead] = time.perf_counter()
                t = time.perf_counter()
                await self._wait(works.pop(i), f"receiving bucket {i} of {num_buckets}")
                arrived = time.perf_counter()
                wire += arrived - t
                t = time.perf_counter()
                named = self._named(bucket, direct[i] if i in direct else bufs[i % depth])
                if i in direct:
                    # landed in the engine's own parameter: only untied aliases still need a copy
                    named = [(target, tensor) for target, tensor in named
                             if target not in self._views or self._views[target].data_ptr() != tensor.data_ptr()]
                if named:
                    await self.engine.load_weights(named)
                load += time.perf_counter() - t
                # per bucket: (posted, arrived, load start, load end)
                timeline.append((posted.pop(i), arrived, t, time.perf_counter()))
        finally:
            # pending Works keep the backend group (and its sockets) alive past close()
            works.clear()
            self._views = {}
        await self.engine.finish_weight_update(version)
        self.stats.update(wire_wait_s=wire, load_s=load, timeline=timeline, direct_buckets=len(direct),
                          direct_bytes=sum(layout.buckets[k].nbytes for k in direct))
        self.incomplete = False
        return {"version": version, "buckets": num_buckets, "bytes": layout.total_bytes, "meta": bool(meta_nbytes)}

    def _direct_targets(self, layout: BucketLayout, device: torch.device) -> dict[int, torch.Tensor]:
        """{bucket index: uint8 view of the engine parameter that bucket is received into}.

        Only for a bucket of one tensor whose engine parameter (the hook's view) is contiguous
        with the same dtype, shape and device: its bytes are the parameter's bytes. Empty when
        the engine has no ``weight_views`` hook (e.g. vLLM) or ``direct=False``.
        """
        hook = getattr(self.engine, "weight_views", None) if self.direct else None
        self._views = (hook() or {}) if hook is not None else {}
        out: dict[int, torch.Tensor] = {}
        for bucket in layout.buckets:
            if len(bucket.slots) != 1:
                continue
            slot = bucket.slots[0]
            view = self._views.get(self._plan[slot.name][0])
            if (view is not None and view.is_contiguous() and view.device == device
                    and dtype_name(view.dtype) == slot.dtype and tuple(view.shape) == slot.shape):
                out[bucket.index] = view.reshape(-1).view(torch.uint8)
        return out

    def _check_layout(self, layout: BucketLayout) -> dict:
        """Match the layout to the engine's parameters; return {sent name: [engine names]}."""
        want = {name: tuple(shape) for name, _dtype, shape in self.engine.param_meta()}
        sent = {s.name: s.shape for b in layout.buckets for s in b.slots}
        plan: dict[str, list[str]] = {name: [] for name in sent}
        for name in sent:
            if name in want:
                plan[name].append(name)
        for alias, source in layout.aliases:
            if alias in want and source in sent:
                plan[source].append(alias)
        covered = {n for names in plan.values() for n in names}
        missing = sorted(set(want) - covered)
        unknown = sorted(n for n, names in plan.items() if not names)
        if missing or unknown:
            raise WeightSyncError(
                f"rank {self.rank}: trainer and engine parameters differ: engine parameters not sent "
                f"{missing[:5]}{'...' if len(missing) > 5 else ''}, sent but unknown to the engine "
                f"{unknown[:5]}{'...' if len(unknown) > 5 else ''}"
            )
        for name, names in plan.items():
            for target in names:
                if want[target] != tuple(sent[name]):
                    raise WeightSyncError(
                        f"rank {self.rank}: {target} has shape {list(want[target])} in the engine, "
                        f"{list(sent[name])} from the trainer"
                    )
        return plan

    def _named(self, bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(target, t) for name, t in unpack(bucket, buf) for target in self._plan[name]]

    async def _wait(self, work, what: str) -> None:
        # Hold the Work only in a box emptied on the way out: a traceback that kept it would
        # keep the backend group, and with it the sockets that must close on failure, alive.
        box = [work]
        del work
        try:
            await self._in_thread(lambda: box[0].wait(), what)
        finally:
            box.clear()

    async def _in_thread(self, fn, what: str) -> None:
        # The collective itself times out after timeout_s (the group's deadline); the extra
        # grace only covers thread scheduling, so this await always ends.
        limit = self.group_config.timeout_s + 5.0
        try:
            await asyncio.wait_for(asyncio.to_thread(fn), limit)
        except TimeoutError as exc:
            raise WeightSyncError(f"rank {self.rank}: {what} took longer than timeout_s={self.group_config.timeout_s}s") from exc
        except WeightSyncError:
            raise
        except Exception as exc:  # noqa: BLE001 - name the step
            raise WeightSyncError(f"rank {self.rank}: {what} failed: {exc}") from exc

    def close(self) -> None:
        """Leave the group and free the buffers; safe to call twice."""
        self._group.close()
        self._bufs.release()
