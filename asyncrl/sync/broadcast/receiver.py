"""The engine's half of the ``broadcast`` backend (the wire protocol: `asyncrl.sync.broadcast`).

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

import torch

from asyncrl.sync.base import GroupInit, ReceiverInit
from asyncrl.sync.broadcast.header import decode_header, empty_header
from asyncrl.sync.buckets import NUM_BUFFERS, BucketBuffers, BucketLayout, unpack
from asyncrl.sync.group import WeightSyncGroup
from asyncrl.sync.lora import LoraMerger
from asyncrl.sync.wire import WeightSyncError, dtype_name


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
        num_buckets, meta_nbytes = await self._receive_layout(group, version)
        layout = self._layout
        landed = await self._receive_buckets(group, layout)
        await self.engine.finish_weight_update(version)
        self.stats.update(landed)
        self.incomplete = False
        return {"version": version, "buckets": num_buckets, "bytes": layout.total_bytes, "meta": bool(meta_nbytes)}

    async def _receive_layout(self, group: WeightSyncGroup, version: int) -> tuple[int, int]:
        """Take the header and, when the sender says it changed, the metadata (the new layout, checked
        against the engine). Returns ``(num_buckets, meta_nbytes)``."""
        header = empty_header(group.device)
        await self._wait(group.broadcast(header), "receiving the sync header")
        meta_nbytes, num_buckets = decode_header(header, rank=self.rank, version=version)
        if meta_nbytes:
            payload = torch.empty(meta_nbytes, dtype=torch.uint8, device=group.device)
            await self._wait(group.broadcast(payload), "receiving the sync metadata")
            self._layout = BucketLayout.decode(payload.cpu().numpy().tobytes())
            self._plan = self._check_layout(self._layout)
            self.stats["meta_received"] += 1
        if self._layout is None:
            raise WeightSyncError(f"rank {self.rank}: no metadata received in this group yet; the sender must send it")
        if num_buckets != len(self._layout.buckets):
            raise WeightSyncError(f"rank {self.rank}: header says {num_buckets} buckets, layout has {len(self._layout.buckets)}")
        return num_buckets, meta_nbytes

    async def _receive_buckets(self, group: WeightSyncGroup, layout: BucketLayout) -> dict:
        """Take every bucket of ``layout`` off the group, each straight into its parameter (direct) or
        staged and loaded, with ``NUM_BUFFERS`` receives posted ahead. Returns the stats of the landing."""
        num_buckets = len(layout.buckets)
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
        return {"wire_wait_s": wire, "load_s": load, "timeline": timeline, "direct_buckets": len(direct),
                "direct_bytes": sum(layout.buckets[k].nbytes for k in direct)}

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
