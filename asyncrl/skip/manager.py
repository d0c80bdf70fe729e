"""`SkipManager`: a class-level registry of skip roles and the decorator that applies them.

A role is a `BaseSkip` subclass registered under a name (``@register_skip("rollout")``); a
function is attached to a role with ``@SkipManager.annotate(role="rollout")``. Each call::

    role off, or not initialised in this process? ── yes ──► run the function
      │ no
    step = SkipManager.step (set_step)  or  skip.extract_step(call)  (support_online_step)
      │
    step not in skip.<role>.steps? ── yes ──► run the function
      │ no
    skip.meet_precondition(step, call)? ── yes ──► skip.warp_function(step, call)  (load the dump)
      │ no (or the dump turned out unusable)
    run the function ─► skip.prepare_data(step, call, result)  (dump it) ─► result

The registry is per process: whichever process runs annotated functions calls
`SkipManager.init` itself (the Rollouter's Ray actor does so in its constructor).
In async functions the disk work (precondition, load, dump) runs in a worker thread so the
event loop keeps serving the other in-flight samples.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from asyncrl.skip.config import SkipAction, SkipConfig, SkipRoleConfig
from asyncrl.skip.store import DumpError, DumpKey, DumpStore

log = logging.getLogger("asyncrl.skip")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class SkipCall:
    """One call of an annotated function, as a skip module sees it."""

    role: str
    function: Callable[..., Any]
    arguments: dict[str, Any]
    """The call's arguments by parameter name (``self`` included for methods)."""
    options: dict[str, Any] = field(default_factory=dict)
    """The keyword arguments given to `SkipManager.annotate` besides ``role``."""


class BaseSkip:
    """One role's skip logic. Subclass it, set the class attributes, register it with `register_skip`.

    The default methods implement ``cache`` and ``repeat`` over a `DumpStore`; a subclass
    usually only overrides `extract_step` (online steps), `should_dump` and `replayed`.
    """

    role: ClassVar[str] = ""
    """Set by `register_skip`."""
    support_actions: ClassVar[tuple[SkipAction, ...]] = (SkipAction.CACHE, SkipAction.REPEAT)
    """Actions this role accepts in its config."""
    support_online_step: ClassVar[bool] = False
    """True: the step comes from each call (`extract_step`); False: from `SkipManager.set_step`."""

    def __init__(self, config: SkipRoleConfig, *, experiment: str, shape: dict):
        if config.action not in self.support_actions:
            raise ValueError(f"skip.{self.role}.action={config.action!r} is not supported by this role; "
                             f"use one of {[a.value for a in self.support_actions]}")
        self.config = config
        self.store = DumpStore(config.dump_dir, DumpKey(experiment=experiment, role=self.role, shape=dict(shape)))
        self.counts: collections.Counter[str] = collections.Counter()
        """``replayed``, ``dumped`` and ``ran`` (listed step, nothing dumped) calls of this role."""
        self.warned_foreign = False

    # ------------------------------------------------------------------ the interface

    def is_enabled(self) -> bool:
        return self.config.enable

    def extract_step(self, call: SkipCall) -> int:
        """The call's own step (roles with ``support_online_step``)."""
        raise NotImplementedError(f"skip role {self.role!r} has support_online_step but no extract_step")

    def meet_precondition(self, step: int, call: SkipCall) -> bool:
        """Whether a dump can stand in for this call: `sources` finds one that passes the cheap checks."""
        return any(self.store.valid(s) for s in self.sources(step))

    def warp_function(self, step: int, call: SkipCall) -> Any:
        """The replayed result: the first source dump that loads and verifies, passed to `replayed`.
        Raises `DumpError` when none does (the function then runs)."""
        reasons = []
        for source in self.sources(step):
            try:
                value = self.store.load(source)
            except FileNotFoundError:
                continue
            except DumpError as e:
                reasons.append(str(e))
                continue
            return self.replayed(value, step=step, source=source, call=call)
        raise DumpError("; ".join(reasons) or f"no dump for step {step}")

    def prepare_data(self, step: int, call: SkipCall, result: Any) -> bool:
        """Dump ``result`` for ``step`` (when `should_dump` agrees); True if it did."""
        why_not = self.should_dump(result)
        if why_not:
            log.info("skip.%s: not dumping step %d: %s", self.role, step, why_not)
            return False
        self.store.write(step, result)
        return True

    # ------------------------------------------------------------------ hooks for subclasses

    def dump_bytes(self, step: int) -> int | None:
        """Size of the first source dump that its ``meta.json`` announces (no lock, no hash: only a
        hint for how to read it), or None when no source has one."""
        for source in self.sources(step):
            try:
                return int(self.store.meta(source)["data_bytes"])
            except (FileNotFoundError, DumpError, KeyError, TypeError, ValueError):
                continue
        return None

    def sources(self, step: int) -> list[int]:
        """Steps whose dump may stand in for ``step``, best first: ``cache`` only ``step`` itself;
        ``repeat`` ``step``, then earlier dumps nearest first, then later ones nearest first."""
        if self.config.action == SkipAction.CACHE:
            return [step]
        have = self.store.steps()
        earlier = sorted((s for s in have if s < step), reverse=True)
        later = sorted(s for s in have if s > step)
        return [step, *earlier, *later]

    def should_dump(self, result: Any) -> str:
        """Why ``result`` must not be dumped ('' to dump it)."""
        return ""

    def replayed(self, value: Any, *, step: int, source: int, call: SkipCall) -> Any:
        """Turn a loaded dump into this call's result (e.g. mark it as replayed)."""
        return value


_REGISTRY: dict[str, type[BaseSkip]] = {}


def register_skip(role: str) -> Callable[[type[BaseSkip]], type[BaseSkip]]:
    """Class decorator: register a `BaseSkip` subclass as the module of ``role``."""
    if not role.isidentifier():
        raise ValueError(f"skip role {role!r} must be an identifier (it is a config field name)")

    def deco(cls: type[BaseSkip]) -> type[BaseSkip]:
        if not (isinstance(cls, type) and issubclass(cls, BaseSkip)):
            raise TypeError(f"@register_skip({role!r}) needs a BaseSkip subclass, got {cls!r}")
        old = _REGISTRY.get(role)
        # The same class defined again (a reloaded module, a re-run notebook cell) replaces itself.
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"skip role {role!r} is already registered by {old.__module__}.{old.__qualname__}")
        cls.role = role
        _REGISTRY[role] = cls
        return cls

    return deco


class SkipManager:
    """Class-level state of this process: the registry's live instances and the shared step."""

    config: ClassVar[SkipConfig | None] = None
    step: ClassVar[int | None] = None
    """The shared step of roles without ``support_online_step`` (the train step)."""
    skip_instances: ClassVar[dict[str, BaseSkip]] = {}

    @classmethod
    def registry(cls) -> dict[str, type[BaseSkip]]:
        return dict(_REGISTRY)

    @classmethod
    def init(cls, config: SkipConfig | Any | None, *, shape: dict | None = None) -> None:
        """Instantiate one module per enabled, registered role of ``config`` (a `SkipConfig`, or any
        object with a ``skip`` attribute holding one). ``shape`` describes what makes a result
        reusable here (model, data, n, token budget, sampling...): dumps of another shape are
        never loaded. An enabled role nobody registered is an error naming it."""
        if config is not None and not isinstance(config, SkipConfig):
            config = getattr(config, "skip", config)
        if config is not None and not isinstance(config, SkipConfig):
            raise TypeError(f"SkipManager.init needs a SkipConfig (or a config with a .skip), got {type(config).__name__}")
        cls.reset()
        cls.config = config
        if config is None:
            return
        for role, role_cfg in config.roles().items():
            if not role_cfg.enable:
                continue
            if role not in _REGISTRY:
                raise ValueError(f"skip.{role} is enabled but no skip module is registered for role {role!r} "
                                 f"(registered: {sorted(_REGISTRY)}); import the module that registers it")
            cls.skip_instances[role] = _REGISTRY[role](role_cfg, experiment=config.experiment, shape=shape or {})
            log.info("skip.%s: %s on steps %s, dumps in %s", role, role_cfg.action,
                     "all" if role_cfg.steps is None else role_cfg.steps, cls.skip_instances[role].store.dir)

    @classmethod
    def reset(cls) -> None:
        """Forget the config, the instances and the step (tests, or a process that re-inits)."""
        cls.config, cls.step, cls.skip_instances = None, None, {}

    @classmethod
    def set_step(cls, step: int) -> None:
        """The current step of every role without ``support_online_step`` (the trainer's step)."""
        if step < 0:
            raise ValueError(f"SkipManager.set_step needs a step >= 0, got {step}")
        cls.step = step

    @classmethod
    def stats(cls) -> dict[str, dict[str, int]]:
        """Per active role: how many calls were ``replayed``, ``dumped``, or ``ran`` without a dump."""
        return {role: dict(s.counts) for role, s in cls.skip_instances.items()}

    @classmethod
    def annotate(cls, role: str, **options: Any) -> Callable[[F], F]:
        """Decorator for a sync or async function whose result ``role`` may cache and replay."""

        def deco(fn: F) -> F:
            signature = inspect.signature(fn)

            def plan(args: tuple, kwargs: dict) -> tuple[BaseSkip, int, SkipCall] | None:
                skip = cls.skip_instances.get(role)
                if skip is None or not skip.is_enabled():
                    return None
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                call = SkipCall(role=role, function=fn, arguments=dict(bound.arguments), options=options)
                if skip.support_online_step:
                    step = skip.extract_step(call)
                elif cls.step is None:
                    raise RuntimeError(f"skip.{role} is enabled but SkipManager.set_step was never called in this "
                                       "process; call it with the train step before the annotated function")
                else:
                    step = cls.step
                return (skip, step, call) if skip.config.listed(step) else None

            if inspect.iscoroutinefunction(fn):
                @functools.wraps(fn)
                async def async_wrapper(*args, **kwargs):
                    planned = plan(args, kwargs)
                    if planned is None:
                        return await fn(*args, **kwargs)
                    skip, step, call = planned
                    hit = await _replay_async(skip, step, call)
                    if hit is not _MISS:
                        skip.counts["replayed"] += 1
                        return hit
                    result = await fn(*args, **kwargs)
                    dumped = await asyncio.to_thread(skip.prepare_data, step, call, result)
                    skip.counts["dumped" if dumped else "ran"] += 1
                    return result

                return async_wrapper  # type: ignore[return-value]

            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                planned = plan(args, kwargs)
                if planned is None:
                    return fn(*args, **kwargs)
                skip, step, call = planned
                hit = _replay(skip, step, call)
                if hit is not _MISS:
                    skip.counts["replayed"] += 1
                    return hit
                result = fn(*args, **kwargs)
                skip.counts["dumped" if skip.prepare_data(step, call, result) else "ran"] += 1
                return result

            return wrapper  # type: ignore[return-value]

        return deco


_MISS = object()

INLINE_READ_BYTES = 256 * 1024
"""An async caller reads dumps up to this size on its own event loop: reading, hashing and decoding
a small dump costs less than handing it to a thread (a group of 8 responses: ~0.15 ms against
~0.5 ms, `scripts/bench_skip.py`). Larger ones are read in a thread, so the loop is not held."""


async def _replay_async(skip: BaseSkip, step: int, call: SkipCall) -> Any:
    size = skip.dump_bytes(step)
    if size is not None and size <= INLINE_READ_BYTES:
        return _replay(skip, step, call)
    return await asyncio.to_thread(_replay, skip, step, call)


def _replay(skip: BaseSkip, step: int, call: SkipCall) -> Any:
    """The dump standing in for this call, or ``_MISS`` (after logging why)."""
    if skip.meet_precondition(step, call):
        try:
            value = skip.warp_function(step, call)
        except DumpError as e:
            log.warning("skip.%s: step %d: no usable dump (%s); running the function", skip.role, step, e)
        else:
            return value
    else:
        for why in skip.store.foreign(step):
            # Once loudly per role (a changed shape usually affects every step), then quietly.
            log.log(logging.INFO if skip.warned_foreign else logging.WARNING, "skip.%s: step %d: not loading %s%s",
                    skip.role, step, why, "" if skip.warned_foreign else " (further such lines at INFO level)")
            skip.warned_foreign = True
    return _MISS

