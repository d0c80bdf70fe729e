"""`WeightSyncCoordinator`: one weight sync across every engine, each step under a deadline.

For every engine: ``pause(mode="keep", clear_cache)`` -> broadcast (every trainer rank's
``send_weights`` with every engine's ``receive_weights``, concurrently) -> the receiver loads
each bucket and calls ``finish_weight_update(version)`` -> ``resume()`` -> ``version += 1``.
Frozen requests continue after resume; their later tokens carry the new version. By default
they keep their KV cache; with ``clear_cache=True`` (async mode's partial rollout) the engines
drop it, so each in-flight response is truncated at the sync in place and goes on from its
prompt + partial response re-read under the new weights.

The coordinator drives Ray actor handles (the interface and the init records are in
`asyncrl.sync.base`); the backend is ``WeightSyncConfig.method``, named once here:

- trainer ranks: ``init_weight_sync(SenderInit) -> list[ReceiverInit] | None`` (rank 0 answers
  one record per engine), ``send_weights(version=)``, ``weight_update_kwargs(version=) -> dict``
  (rank 0; merged into every ``receive_weights`` call, e.g. vLLM's names/dtypes/shapes);
- engines: ``init_weight_sync(ReceiverInit)``, ``receive_weights(version=, **update)``,
  ``pause(mode, clear_cache)``, ``resume()``, ``version()``, and for ``vllm`` with
  ``wire_dtype="engine"`` ``weight_dtype()``.

Failures. An engine that dies or fails during a transfer breaks the group for everyone
(a collective cannot lose a member), so the coordinator pings every engine, drops the
dead ones, re-forms the group with the live ones and re-sends the whole set (``retries``
times). Engines that end with a complete set resume on the new version; an engine that
did not is left paused (never resumed on half-loaded weights: its receiver has not called
``finish_weight_update``) and is retried on the next sync; then `sync` raises
`WeightSyncError` naming every failed engine and the step and setting that failed.
`add_engine` puts a replica (a restarted one) back: the next sync forms the group anew with it and
gives it that sync's weights. Leaves out: pipelining syncs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl import rpc
from asyncrl.rpc import Links
from asyncrl.sync.base import GroupInit, ReceiverInit, SenderInit, WeightSyncer
from asyncrl.sync.config import WeightSyncConfig
from asyncrl.sync.wire import WeightSyncError

__all__ = ["SyncReport", "WeightSyncConfig", "WeightSyncCoordinator", "WeightSyncError", "WeightSyncer"]


@dataclass
class SyncReport:
    """What the last sync did (for metrics)."""

    version: int = 0
    pause_s: float = 0.0
    transfer_s: float = 0.0
    resume_s: float = 0.0
    total_s: float = 0.0
    attempts: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    """engine name -> why it failed."""
    attempt_errors: list[dict[str, str]] = field(default_factory=list)
    """Per transfer attempt: member (engine name, or ``trainer``) -> its error."""


class WeightSyncCoordinator:
    """Drive weight syncs from the trainer ranks to every engine (see module doc)."""

    def __init__(self, trainer_workers: Sequence[Any], engine_actors: Sequence[Any] | Mapping[str, Any],
                 config: WeightSyncConfig | None = None, *, version: int = 0, clear_cache: bool = False,
                 rpc: bool = True) -> None:
        if not trainer_workers:
            raise ValueError("trainer_workers is empty: pass every trainer rank's actor, rank 0 first")
        if isinstance(engine_actors, Mapping):
            engines = dict(engine_actors)
        else:
            engines = {engine_name(i): h for i, h in enumerate(engine_actors)}
        if not engines:
            raise ValueError("engine_actors is empty: the weight sync needs at least one engine")
        self.trainers = list(trainer_workers)
        self.engines: dict[str, Any] = engines
        """Live engines by name (dead ones are dropped and listed in ``dead``)."""
        self.dead: dict[str, str] = {}
        self.config = config or WeightSyncConfig()
        self.clear_cache = clear_cache
        """Engines drop the KV cache of their frozen requests at each sync (they re-read it after)."""
        self._version = version
        self._members: tuple[str, ...] | None = None  # engines in the current group, in rank order
        self._epoch = 0
        self._lock = asyncio.Lock()
        self.last = SyncReport(version=version)
        self.joined = 0
        """Engines added after start (`add_engine`): restarted replicas."""
        self._rpc = rpc
        self._linked: set[str] = set()
        """Engines called over ZeroMQ (`asyncrl.rpc.link`, made at the first sync they take part in)."""
        self._links = Links()

    def add_engine(self, name: str, handle: Any) -> None:
        """Add (or replace) engine ``name``; the next sync re-forms the group with it and gives it
        that sync's weights before it resumes."""
        self.engines[name] = handle
        self._linked.discard(name)
        self.dead.pop(name, None)
        self._members = None
        self.joined += 1

    def close(self) -> None:
        """Close the sockets to the engines (`Links.close`): the run's shutdown, after the last sync."""
        self._links.close()

    @property
    def version(self) -> int:
        """Number of weight syncs so far (the version engines serve after a sync)."""
        return self._version

    # -- the sync ---------------------------------------------------------------------------

    async def sync(self) -> int:
        """Pause keep -> broadcast -> load -> resume on every engine; return the new version."""
        async with self._lock:  # one sync at a time: each one re-reads the trainer's weights
            return await self._sync(self._version + 1)

    async def republish(self) -> int:
        """Put the trainer's current weights into every engine under the current version (no new
        version): a resumed run's engines serve the restored weights before they generate."""
        async with self._lock:
            return await self._sync(self._version)

    async def _sync(self, target: int) -> int:
        cfg, t0 = self.config, time.perf_counter()
        report = SyncReport(version=target)
        await self._link()
        # With the group formed, rank 0's per-sync metadata does not depend on the engines: ask for
        # it while they pause (one round trip less in every sync).
        extra = asyncio.ensure_future(self._update_kwargs(target)) if self._members is not None else None
        try:
            paused, failed = await self._pause_all()
            report.pause_s = time.perf_counter() - t0

            t1 = time.perf_counter()
            landed, trainer_error = await self._transfer(paused, target, failed, report, extra)
            report.transfer_s = time.perf_counter() - t1
        finally:
            if extra is not None and not extra.done():
                extra.cancel()
            elif extra is not None and not extra.cancelled():
                extra.exception()  # retrieved (no engine was left to send to): not logged as lost

        t2 = time.perf_counter()
        resumed, errors = await self._each(
            landed, lambda h: h.resume.remote(), cfg.resume_timeout_s, "resume_timeout_s", "resume"
        )
        await self._drop_dead(errors)  # one that died after its transfer, as at the pause
        failed.update(errors)
        report.resume_s = time.perf_counter() - t2
        report.total_s = time.perf_counter() - t0
        report.failed = failed
        self.last = report
        if landed:
            self._version = target
        if trainer_error:
            failed["trainer"] = trainer_error
        if failed:
            served = ", ".join(resumed) or "none"
            detail = "; ".join(f"{n}: {why}" for n, why in failed.items())
            raise WeightSyncError(
                f"weight sync to version {target} failed for {', '.join(failed)} ({detail}); "
                f"resumed on version {self._version}: {served}"
            )
        return target

    async def _pause_all(self) -> tuple[list[str], dict[str, str]]:
        """``pause(keep)`` every engine: (paused names, failures); dead engines are dropped."""
        paused, errors = await self._each(list(self.engines), lambda h: h.pause.remote("keep", self.clear_cache),
                                          self.config.pause_timeout_s, "pause_timeout_s", "pause")
        await self._drop_dead(errors)
        return paused, dict(errors)

    async def _transfer(self, names: list[str], target: int, failed: dict[str, str],
                        report: SyncReport, extra: asyncio.Future | None) -> tuple[list[str], str | None]:
        """Broadcast + load, re-sending to the live engines after a failure: (landed, trainer error)."""
        landed, todo, trainer_error = [], names, None
        for attempt in range(1 + self.config.retries):
            if not todo:
                break
            report.attempts = attempt + 1
            landed, errors, trainer_error = await self._attempt(todo, target, extra)
            report.attempt_errors.append({**errors, **({"trainer": trainer_error} if trainer_error else {})})
            if not errors:
                break
            # One member failing breaks the collective for all: drop the dead, re-send to the live.
            alive, dead = await self._ping(todo)
            for name in dead:
                self._drop(name, errors.get(name, "died during the sync"))
            failed.update({n: self.dead[n] for n in dead})
            failed.update({n: why for n, why in errors.items() if n in alive})
            todo = alive
        for name in landed:
            failed.pop(name, None)
        return landed, trainer_error

    async def _update_kwargs(self, target: int) -> dict:
        """Per-sync metadata the engines' ``receive_weights`` takes from the caller ({} for broadcast)."""
        return await self._one(self.trainers[0].weight_update_kwargs.remote(version=target),
                               self.config.transfer_timeout_s, "transfer_timeout_s", "weight_update_kwargs")

    async def _attempt(self, names: list[str], target: int,
                       extra: asyncio.Future | None) -> tuple[list[str], dict[str, str], str | None]:
        """Connect if the group is not exactly ``names``, then one transfer: (landed, errors, trainer error).
        ``extra``: rank 0's metadata asked for before the pause, used unless the group is formed anew."""
        cfg = self.config
        if self._members != tuple(names):
            errors = await self._connect(names)
            if errors:
                return [], errors, None
            extra = None  # a new group: rank 0's metadata is asked for afresh
        kwargs = await extra if extra is not None else await self._update_kwargs(target)
        refs = {n: self.engines[n].receive_weights.remote(**{"version": target, **kwargs}) for n in names}
        trainer_refs = [w.send_weights.remote(version=target) for w in self.trainers]
        (ok, errors), (_, trainer_errors) = await asyncio.gather(
            self._wait(refs, cfg.transfer_timeout_s, "transfer_timeout_s", "receive"),
            self._wait(dict(enumerate(trainer_refs)), cfg.transfer_timeout_s, "transfer_timeout_s", "send"),
        )
        if errors or trainer_errors:
            self._members = None  # a failed collective leaves the group unusable
        # Engines whose receive returned hold a complete set (the receiver checks every bucket),
        # even if a trainer rank failed afterwards; that failure is reported, not hidden.
        trainer_error = "; ".join(f"rank {r}: {why}" for r, why in trainer_errors.items()) or None
        return list(ok), errors, trainer_error

    async def _connect(self, names: list[str]) -> dict[str, str]:
        """Form a fresh sync group of trainer rank 0 + ``names``; returns engines that failed to join."""
        cfg = self.config
        self._epoch += 1
        init = SenderInit(
            method=cfg.method, bucket_mb=cfg.bucket_mb, workers_per_engine=cfg.workers_per_engine,
            wire_dtype=await self._wire_dtype(names),
            group=GroupInit(master_addr=cfg.master_addr, master_port=cfg.master_port, backend=cfg.backend,
                            world_size=1 + cfg.workers_per_engine * len(names), timeout_s=cfg.transfer_timeout_s,
                            join_timeout_s=cfg.connect_timeout_s, group_name=f"asyncrl-weight-sync-{self._epoch}"),
        )
        refs = [t.init_weight_sync.remote(init) for t in self.trainers]
        results, errors = await self._wait(dict(enumerate(refs)), cfg.connect_timeout_s, "connect_timeout_s", "init_weight_sync")
        if errors:
            raise WeightSyncError(f"trainer ranks could not open the weight-sync group: {errors}")
        inits = results.get(0)
        if not isinstance(inits, list) or len(inits) != len(names) or not all(isinstance(i, ReceiverInit) for i in inits):
            raise WeightSyncError(f"trainer rank 0's init_weight_sync returned {inits!r}, not one ReceiverInit "
                                  f"for each of {len(names)} engines")
        refs = {n: self.engines[n].init_weight_sync.remote(inits[i]) for i, n in enumerate(names)}
        _, errors = await self._wait(refs, cfg.connect_timeout_s, "connect_timeout_s", "join the sync group")
        self._members = None if errors else tuple(names)
        return errors

    async def _wire_dtype(self, names: list[str]) -> str | None:
        """The dtype weights travel in (``vllm``): the engines' when ``wire_dtype="engine"``."""
        cfg = self.config
        if cfg.method != "vllm" or cfg.wire_dtype == "trainer":
            return None
        if cfg.wire_dtype != "engine":
            return cfg.wire_dtype
        dtypes, errors = await self._wait({n: self.engines[n].weight_dtype.remote() for n in names},
                                          cfg.connect_timeout_s, "connect_timeout_s", "weight_dtype")
        if errors:
            raise WeightSyncError(f"engines did not report their weight dtype: {errors}")
        found = set(dtypes.values())
        if len(found) != 1:
            raise WeightSyncError(f"engines run different dtypes {dtypes}: set WeightSyncConfig.wire_dtype explicitly")
        return found.pop()

    # -- helpers ----------------------------------------------------------------------------

    async def _link(self) -> None:
        """Engines not linked yet are called over ZeroMQ from now on where they serve it (`asyncrl.rpc`):
        a sync's 3 x N pause / update / resume calls then cost a fraction of Ray calls. One that does
        not answer stays a Ray handle (the pause finds out what it is)."""
        names = [n for n in self.engines if n not in self._linked] if self._rpc else []
        if names:
            self._linked |= await rpc.link_each(self.engines, names, self.config.pause_timeout_s, self._links)

    async def _each(self, names, call, timeout: float, setting: str, step: str):
        refs = {n: call(self.engines[n]) for n in names}
        ok, errors = await self._wait(refs, timeout, setting, step)
        return list(ok), errors

    async def _wait(self, refs: Mapping[Any, Any], timeout: float, setting: str, step: str):
        """Await every ref under one deadline; (results by key, errors by key naming step and setting).
        A ref is a Ray ObjectRef, an awaitable, or a future (an `asyncrl.rpc` call: no task for it)."""
        tasks = {k: asyncio.ensure_future(r) for k, r in refs.items()}
        if tasks:
            await asyncio.wait(tasks.values(), timeout=timeout)
        results, errors = {}, {}
        for k, task in tasks.items():
            if not task.done():
                task.cancel()
                errors[k] = f"{step} did not finish within WeightSyncConfig.{setting}={timeout}s"
            elif task.exception() is not None:
                errors[k] = f"{step} failed: {_short(task.exception())}"
            else:
                results[k] = task.result()
        return results, errors

    async def _one(self, ref, timeout: float, setting: str, step: str):
        results, errors = await self._wait({0: ref}, timeout, setting, step)
        if errors:
            raise WeightSyncError(f"trainer rank 0: {errors[0]}")
        return results[0]

    async def _ping(self, names: list[str]) -> tuple[list[str], list[str]]:
        """Split ``names`` into engines that answer ``version()`` and dead ones."""
        ok, errors = await self._each(names, lambda h: h.version.remote(), self.config.pause_timeout_s,
                                      "pause_timeout_s", "liveness ping")
        return [n for n in names if n in ok], [n for n in names if n in errors]

    async def _drop_dead(self, errors: Mapping[str, str]) -> None:
        """Ping the engines that failed a step and drop the dead ones with their error (a restart brings
        them back); one that still answers stays."""
        if errors:
            _, dead = await self._ping(list(errors))
            for name in dead:
                self._drop(name, errors[name])

    def _drop(self, name: str, why: str) -> None:
        self.engines.pop(name, None)
        self.dead[name] = why


def engine_name(index: int) -> str:
    """The name of engine ``index`` when the coordinator is given a list of engines: ``engine[3]``."""
    return f"engine[{index}]"


def engine_index(name: str) -> int | None:
    """The inverse of `engine_name`; None for a name that is not of that form."""
    try:
        return int(name.removeprefix("engine[").removesuffix("]"))
    except ValueError:
        return None


def _short(exc: BaseException) -> str:
    import ray

    if isinstance(exc, ray.exceptions.RayActorError):
        return f"engine actor died ({type(exc).__name__})"
    text = str(exc).strip().splitlines()
    tail = [line for line in text if "Error" in line] or text or [type(exc).__name__]
    return tail[-1][:300]
