"""`WeightSyncCoordinator`: one weight sync across every engine, each step under a deadline.

For every engine: ``pause(mode="keep", clear_cache=False)`` -> broadcast (every trainer
rank's ``send_weights`` with every engine's ``receive_weights``, concurrently) -> the
receiver loads each bucket and calls ``finish_weight_update(version)`` -> ``resume()`` ->
``version += 1``. Frozen requests keep their KV cache and continue after resume; their
later tokens carry the new version.

The coordinator drives Ray actor handles through these methods only, so any engine actor
that has them plugs in (the built-in engine via `asyncrl.sync.receiver`, vLLM through its
own weight-transfer engine):

- trainer ranks: ``init_weight_sync(**group) -> dict | list | None`` (rank 0 returns
  ``{master_addr, master_port}``, or one complete init dict per engine for a sender that
  speaks the engine's own protocol, e.g. `asyncrl.sync.vllm`), ``send_weights(version=)``,
  and optionally ``weight_update_kwargs(version=) -> dict`` (rank 0; merged into every
  ``receive_weights`` call, e.g. vLLM's names/dtypes/shapes);
- engines: ``init_weight_sync(master_addr=, master_port=, rank_offset=, world_size=,
  backend=, timeout_s=, group_name=)``, ``receive_weights(version=, **receive_kwargs)``,
  ``pause(mode, clear_cache)``, ``resume()``, ``version()``.

Failures. An engine that dies or fails during a transfer breaks the group for everyone
(a collective cannot lose a member), so the coordinator pings every engine, drops the
dead ones, re-forms the group with the live ones and re-sends the whole set (``retries``
times). Engines that end with a complete set resume on the new version; an engine that
did not is left paused (never resumed on half-loaded weights: its receiver has not called
``finish_weight_update``) and is retried on the next sync; then `sync` raises
`WeightSyncError` naming every failed engine and the step and setting that failed.
Leaves out: adding engines after start (build a new coordinator), pipelining syncs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from asyncrl.sync.config import WeightSyncConfig
from asyncrl.sync.sender import WeightSyncError


@runtime_checkable
class WeightSyncer(Protocol):
    """What the Trainer needs: put its current weights into every engine."""

    async def sync(self) -> int:
        """Run one weight sync; return the new version."""
        ...


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
                 config: WeightSyncConfig | None = None, *, version: int = 0) -> None:
        if not trainer_workers:
            raise ValueError("trainer_workers is empty: pass every trainer rank's actor, rank 0 first")
        if isinstance(engine_actors, Mapping):
            engines = dict(engine_actors)
        else:
            engines = {f"engine[{i}]": h for i, h in enumerate(engine_actors)}
        if not engines:
            raise ValueError("engine_actors is empty: the weight sync needs at least one engine")
        self.trainers = list(trainer_workers)
        self.engines: dict[str, Any] = engines
        """Live engines by name (dead ones are dropped and listed in ``dead``)."""
        self.dead: dict[str, str] = {}
        self.config = config or WeightSyncConfig()
        self._version = version
        self._members: tuple[str, ...] | None = None  # engines in the current group, in rank order
        self._epoch = 0
        self._lock = asyncio.Lock()
        self.last = SyncReport(version=version)

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
        paused, failed = await self._pause_all()
        report.pause_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        landed, trainer_error = await self._transfer(paused, target, failed, report)
        report.transfer_s = time.perf_counter() - t1

        t2 = time.perf_counter()
        resumed, errors = await self._each(
            landed, lambda h: h.resume.remote(), cfg.resume_timeout_s, "resume_timeout_s", "resume"
        )
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
        paused, errors = await self._each(list(self.engines), lambda h: h.pause.remote("keep", False),
                                          self.config.pause_timeout_s, "pause_timeout_s", "pause")
        if errors:
            _, dead = await self._ping(list(errors))
            for name in dead:
                self._drop(name, errors[name])
        return paused, dict(errors)

    async def _transfer(self, names: list[str], target: int, failed: dict[str, str],
                        report: SyncReport) -> tuple[list[str], str | None]:
        """Broadcast + load, re-sending to the live engines after a failure: (landed, trainer error)."""
        landed, todo, trainer_error = [], names, None
        for attempt in range(1 + self.config.retries):
            if not todo:
                break
            report.attempts = attempt + 1
            landed, errors, trainer_error = await self._attempt(todo, target)
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

    async def _attempt(self, names: list[str], target: int) -> tuple[list[str], dict[str, str], str | None]:
        """Connect if the group is not exactly ``names``, then one transfer: (landed, errors, trainer error)."""
        cfg = self.config
        if self._members != tuple(names):
            errors = await self._connect(names)
            if errors:
                return [], errors, None
        extra = {}
        if hasattr(self.trainers[0], "weight_update_kwargs"):
            # per-sync metadata for engines whose transfer protocol wants it from the caller (vLLM)
            extra = await self._one(self.trainers[0].weight_update_kwargs.remote(version=target),
                                    cfg.transfer_timeout_s, "transfer_timeout_s", "weight_update_kwargs")
        refs = {n: self.engines[n].receive_weights.remote(**{"version": target, **extra}) for n in names}
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
        w = cfg.workers_per_engine
        group = dict(backend=cfg.backend, timeout_s=cfg.transfer_timeout_s, world_size=1 + w * len(names),
                     group_name=f"asyncrl-weight-sync-{self._epoch}")
        refs = [t.init_weight_sync.remote(bucket_mb=cfg.bucket_mb, master_addr=cfg.master_addr,
                                          master_port=cfg.master_port, **group) for t in self.trainers]
        results, errors = await self._wait(dict(enumerate(refs)), cfg.connect_timeout_s, "connect_timeout_s", "init_weight_sync")
        if errors:
            raise WeightSyncError(f"trainer ranks could not open the weight-sync group: {errors}")
        rank0 = next((r for r in results.values() if r), None)
        if isinstance(rank0, list):
            # a sender that speaks an engine's own transfer protocol (asyncrl.sync.vllm) hands
            # out one complete init dict per engine
            if len(rank0) != len(names):
                raise WeightSyncError(f"trainer rank 0 returned {len(rank0)} engine init dicts for {len(names)} engines")
            refs = {n: self.engines[n].init_weight_sync.remote(**rank0[i]) for i, n in enumerate(names)}
        elif isinstance(rank0, dict) and "master_port" in rank0:
            refs = {
                n: self.engines[n].init_weight_sync.remote(
                    master_addr=rank0["master_addr"], master_port=rank0["master_port"], rank_offset=1 + i * w, **group
                )
                for i, n in enumerate(names)
            }
        else:
            raise WeightSyncError(f"trainer rank 0's init_weight_sync returned {rank0!r}, not {{master_addr, master_port}}")
        _, errors = await self._wait(refs, cfg.connect_timeout_s, "connect_timeout_s", "join the sync group")
        self._members = None if errors else tuple(names)
        return errors

    # -- helpers ----------------------------------------------------------------------------

    async def _each(self, names, call, timeout: float, setting: str, step: str):
        refs = {n: call(self.engines[n]) for n in names}
        ok, errors = await self._wait(refs, timeout, setting, step)
        return list(ok), errors

    async def _wait(self, refs: Mapping[Any, Any], timeout: float, setting: str, step: str):
        """Await every ref under one deadline; (results by key, errors by key naming step and setting)."""

        async def one(ref):
            return await ref

        tasks = {k: asyncio.ensure_future(one(r)) for k, r in refs.items()}
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

    def _drop(self, name: str, why: str) -> None:
        self.engines.pop(name, None)
        self.dead[name] = why


def _short(exc: BaseException) -> str:
    import ray

    if isinstance(exc, ray.exceptions.RayActorError):
        return f"engine actor died ({type(exc).__name__})"
    text = str(exc).strip().splitlines()
    tail = [line for line in text if "Error" in line] or text or [type(exc).__name__]
    return tail[-1][:300]
