"""Configuration of the SkipManager: ``skip.experiment`` and one `SkipRoleConfig` per role.

The root config composes `SkipConfig` under ``skip``, so a run says for example::

    skip.experiment=reward-v2 skip.async_rollout.enable=true skip.async_rollout.steps=[0,1,2]

A custom role adds its own field to a subclass of `SkipConfig` (see `asyncrl.skip`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class SkipAction(StrEnum):
    """What a role does on a listed step."""

    CACHE = "cache"
    """Load this step's dump when one is valid; otherwise run the function and dump its result."""
    REPEAT = "repeat"
    """Load this step's dump, else the nearest earlier step's, else the nearest later one's;
    run (and dump) only when the role has no valid dump at all."""


@dataclass(kw_only=True)
class SkipRoleConfig:
    """``skip.<role>``: whether and on which steps one role is skipped."""

    enable: bool = False
    """Turn the role on; off, the annotated function always runs and nothing is dumped."""
    dump_dir: str = "skip_dumps"
    """Root directory of the dumps (shared by every experiment; relative paths are from the cwd)."""
    steps: list[int] | None = None
    """Steps eligible for skip logic; None means every step. What a step is depends on the role:
    the train step for ``rollout``, the feed index of ``sample_{epoch}_{index}`` for ``async_rollout``."""
    action: Literal["cache", "repeat"] = "cache"
    """``cache`` or ``repeat`` (see `SkipAction`)."""

    def __post_init__(self) -> None:
        if self.action not in tuple(SkipAction):
            raise ValueError(f"skip action must be one of {[a.value for a in SkipAction]}, got {self.action!r}")
        self.action = str(self.action)  # plain text, as OmegaConf's Literal field wants it
        if self.steps is not None:
            steps = list(self.steps)
            bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or s < 0]
            if bad:
                raise ValueError(f"skip steps must be integers >= 0, got {bad}")
            if self.enable and not steps:
                raise ValueError("skip steps is an empty list: list the steps to skip, or null for every step")
            self.steps = sorted(set(steps))
        if self.enable and not self.dump_dir:
            raise ValueError("skip dump_dir is empty; give the directory that holds the dumps")

    def listed(self, step: int) -> bool:
        """Whether ``step`` is eligible for skip logic."""
        return self.steps is None or step in self.steps


@dataclass(kw_only=True)
class SkipConfig:
    """``skip``: the experiment key and the built-in roles."""

    experiment: str = "default"
    """Experiment key: dumps are only ever loaded by runs with the same key (and the same shape)."""
    rollout: SkipRoleConfig = field(default_factory=SkipRoleConfig)
    """Batch generation of the synchronous path; the step is the train step (`SkipManager.set_step`)."""
    async_rollout: SkipRoleConfig = field(default_factory=SkipRoleConfig)
    """One sample's generation on the Rollouter; the step is the feed index in its ``sample_id``."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.experiment):
            raise ValueError(f"skip.experiment must be a file-name-safe key (letters, digits, '.', '_', '-'), "
                             f"got {self.experiment!r}")

    def roles(self) -> dict[str, SkipRoleConfig]:
        """Every field that configures a role, by role name."""
        return {name: value for name, value in vars(self).items() if isinstance(value, SkipRoleConfig)}


def load_skip_config(path: str | None = None, overrides: list[str] = (), *,
                     schema: type[SkipConfig] = SkipConfig) -> SkipConfig:
    """`SkipConfig` from a YAML file (its ``skip:`` section, or the fields at top level) and dotted
    overrides such as ``async_rollout.steps=[0,1,2]`` (a leading ``skip.`` is accepted).
    ``schema`` is a subclass of `SkipConfig` when custom roles add fields.

    Relative ``dump_dir``s are made absolute here, so every process of the run finds the same
    directory whatever its working directory. ValueError names the file, key or value at fault.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    merged = OmegaConf.structured(schema)
    try:
        if path is not None:
            loaded = OmegaConf.load(path)
            section = loaded.get("skip", loaded) if hasattr(loaded, "get") else loaded
            merged = OmegaConf.merge(merged, section)
        dotted = [o[len("skip."):] if o.startswith("skip.") else o for o in overrides]
        bad = [o for o in dotted if "=" not in o]
        if bad:
            raise ValueError(f"skip overrides look like role.key=value, got {bad}")
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(dotted))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        where = f" in {path}" if path else ""
        raise ValueError(f"skip config{where}: {str(e).splitlines()[0]}") from None
    return absolute_dump_dirs(cfg)


def absolute_dump_dirs(cfg: SkipConfig) -> SkipConfig:
    """A copy of ``cfg`` whose ``dump_dir``s are absolute (resolved against this process's cwd), so
    processes started elsewhere (Ray actors) find the same directories."""
    import copy
    from pathlib import Path

    cfg = copy.deepcopy(cfg)
    for role in cfg.roles().values():
        role.dump_dir = str(Path(role.dump_dir).resolve())
    return cfg
