"""``skip``: the SkipManager's roles a run can use."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.skip.config import SkipConfig, SkipRoleConfig


@dataclass(kw_only=True)
class RunSkipConfig:
    """``skip``: the SkipManager's roles a run can use. The ``rollout`` role (a train step's
    batch, `SkipManager.set_step`) is for a user's own loop; the launcher's Rollouter generates
    per sample, so a run skips it with ``async_rollout``."""

    experiment: str = "default"
    """Experiment key: dumps are only ever loaded by runs with the same key (and the same shape)."""
    async_rollout: SkipRoleConfig = field(default_factory=SkipRoleConfig)
    """One sample's generation on the Rollouter; the step is the feed index in its ``sample_id``."""

    def __post_init__(self) -> None:
        self.skip_config()  # the experiment key's check is SkipConfig's

    def skip_config(self) -> SkipConfig:
        """The SkipManager's config for the run's processes (`SkipManager.init`)."""
        return SkipConfig(experiment=self.experiment, async_rollout=self.async_rollout)
