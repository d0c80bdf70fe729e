"""`WeightReceiver`: the engine side of a weight sync, used inside an engine actor.

`connect` joins the weight-sync group as rank ``rank_offset``; `receive` takes one sync off
the group (header, metadata when it changed, then the buckets; see `asyncrl.sync.sender`)
and hands every bucket to ``engine.load_weights`` as it lands, while the next bucket is
already being received into the other of two buffers. The tensors given to
``load_weights`` are views into a reused buffer: the engine copies them (as the
`RolloutEngine` contract says).

Blocking collectives run in a worker thread under the group's ``timeout_s``, so the
actor's event loop keeps serving (e.g. ``version()`` pings) while weights travel.

Never a mix of old and new weights: the caller (the coordinator) pauses the engine with
``keep`` before `receive`, so nothing generates while buckets land (the built-in engine
copies each bucket into its model in place); ``finish_weight_update(version)`` is called
only after every bucket of the layout landed, and the coordinator resumes an engine only
after its `receive` returned. If a receive fails half way, `receive` raises, the group is
dropped, ``finish_weight_update`` is not called, ``incomplete`` stays True, and the engine
stays paused until a later complete receive (the coordinator re-sends the whole set).
Leaves out: several workers per engine (one rank per receiver), receiving straight into
the engine's parameter memory (it would save the load copy, the largest cost on CPU, but
needs an engine hook the `RolloutEngine` interface does not have).
"""

from __future__ import annotations

import asyncio
import time

import torch

from asyncrl.sync.buckets import NUM_BUFFERS, BucketBuffers, BucketLayout, unpack
from asyncrl.sync.group import SyncGroupConfig, WeightSyncGroup
from asyncrl.sync.sender import HEADER_LEN, MAGIC, WeightSyncError


class WeightReceiver:
    """Receive weights from trainer rank 0 into one engine (see module doc)."""

    def __init__(self, engine, *, rank_offset: int, **group) -> None:
        self.engine = engine
        self.rank = rank_offset
        self.group_config = SyncGroupConfig(**group)
        self._group = WeightSyncGroup(self.group_config, rank=rank_offset)
        self._layout: BucketLayout | None = None
        self._plan: dict | None = None
        self._bufs = BucketBuffers(self._group.device)
        self.incomplete = False
        """True from the first loaded bucket of a sync until its ``finish_weight_update``."""
        self.stats = {"syncs": 0, "meta_received": 0, "bytes_received": 0, "last_receive_s": 0.0}

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

        depth = min(NUM_BUFFERS, num_buckets)
        bufs = [self._bufs.get(slot, layout.max_bucket_bytes) for slot in range(depth)]
        works: dict = {}
        try:
            for k in range(max(1, depth - 1) if num_buckets else 0):
                works[k] = group.broadcast(bufs[k][: layout.buckets[k].nbytes])
            self.incomplete = True
            wire = load = 0.0
            for i, bucket in enumerate(layout.buckets):
                t = time.perf_counter()
                await self._wait(works.pop(i), f"receiving bucket {i} of {num_buckets}")
                wire += time.perf_counter() - t
                ahead = i + depth - 1
                if ahead > i and ahead < num_buckets:
                    # keep receives posted ahead while this bucket loads, so the wire never idles
                    works[ahead] = group.broadcast(bufs[ahead % depth][: layout.buckets[ahead].nbytes])
                t = time.perf_counter()
                await self.engine.load_weights(self._named(bucket, bufs[i % depth]))
                load += time.perf_counter() - t
        finally:
            # pending Works keep the backend group (and its sockets) alive past close()
            works.clear()
        await self.engine.finish_weight_update(version)
        self.stats.update(wire_wait_s=wire, load_s=load)
        self.incomplete = False
        return {"version": version, "buckets": num_buckets, "bytes": layout.total_bytes, "meta": bool(meta_nbytes)}

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
