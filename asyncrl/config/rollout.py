"""``rollout``: RolloutConfig less ``groups_per_sync``, which is the Trainer's (``trainer.groups_per_batch x
require_batches x trigger_parameter_sync_step``): the run passes it in when it builds the Rollouter's config."""

from __future__ import annotations

from asyncrl.config.section import section_of, values
from asyncrl.rollouter.config import RolloutConfig

RolloutSection = section_of(
    "RolloutSection", (RolloutConfig,), module=__name__, leave_out={"groups_per_sync"}, validate=True,
    doc=RolloutConfig.__doc__ or "")


def rollout_config(section: RolloutSection, groups_per_sync: int) -> RolloutConfig:  # type: ignore[valid-type]
    """The Rollouter's `RolloutConfig`: the section plus the Trainer's groups per weight sync."""
    return RolloutConfig(groups_per_sync=groups_per_sync, **values(section))
