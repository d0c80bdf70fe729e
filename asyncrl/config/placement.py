"""``placement``: where the processes run on the Ray cluster."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.config.errors import ConfigError
from asyncrl.config.flags import named


@dataclass(kw_only=True)
class PlacementConfig:
    """Where the processes run on the Ray cluster."""

    rollouter_gpus: int = 0
    """GPUs for the engine replicas; 0: built-in engines on CPU."""
    trainer_gpus: int = 0
    """GPUs for the FSDP2 trainer ranks (one rank each); 0: CPU ranks."""
    engines: int = 1
    """Engine replicas when ``rollouter_gpus`` is 0."""
    trainer_ranks: int = 1
    """Trainer ranks when ``trainer_gpus`` is 0."""
    nodes: int = 1
    """Nodes to spread over: GPU runs put the Rollouter's and the Trainer's GPUs on separate
    nodes when 2 or more; CPU runs put the Rollouter with its engines on one node, the Trainer's
    ranks on another."""
    gpus_per_node: int | None = None
    """GPUs to use on each node; None: what the cluster reports."""
    address: str | None = None
    """Ray cluster to join (``auto``, ``ray://...``, ``host:port``); None: ``RAY_ADDRESS`` if set
    (so ``ray job submit`` works), else a local Ray started for the run."""
    ready_timeout_s: float = 600.0
    """Deadline for every engine replica and the Rollouter to load and report ready."""

    def __post_init__(self) -> None:
        for name in ("rollouter_gpus", "trainer_gpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("engines", "trainer_ranks", "nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1 or None, got {self.gpus_per_node}")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {self.ready_timeout_s}")



def check_placement(p: PlacementConfig) -> None:
    """GPUs for both sides or for neither: a run is a GPU run or a CPU run."""
    if (p.rollouter_gpus > 0) != (p.trainer_gpus > 0):
        raise ConfigError(f"{named('placement.rollouter_gpus')}={p.rollouter_gpus} and "
                          f"{named('placement.trainer_gpus')}={p.trainer_gpus}: give both (GPU run) or neither (CPU run)")
