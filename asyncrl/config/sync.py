"""``weight_sync``: WeightSyncConfig less ``workers_per_engine``, which follows from the engines."""

from __future__ import annotations

from asyncrl.config.section import section_of, values
from asyncrl.sync.config import WeightSyncConfig

WeightSyncSection = section_of(
    "WeightSyncSection", (WeightSyncConfig,), module=__name__, leave_out={"workers_per_engine"}, validate=True,
    doc=WeightSyncConfig.__doc__ or "")


def weight_sync_config(section: WeightSyncSection, workers_per_engine: int) -> WeightSyncConfig:  # type: ignore[valid-type]
    """The processes' `WeightSyncConfig`: the section plus the engines' workers per replica."""
    return WeightSyncConfig(workers_per_engine=workers_per_engine, **values(section))
