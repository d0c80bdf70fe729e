"""The in-process weight sync: engines that live in the trainer's process get rank 0's full weights.

`InProcessSyncer` is a `asyncrl.sync.base.WeightSyncer` without a group, sender or receiver:
it gathers the full state dict from the trainer ranks (a collective; rank 0 returns it on
CPU) and, per engine, ``pause("keep") -> load_weights -> finish_weight_update -> resume``.
Fine for one local engine and a small model (the on-policy loop, tests); engines in other
processes use the ``broadcast`` or ``vllm`` backend through `WeightSyncCoordinator`.
Leaves out: bucketing (the whole state dict is held at once), engines in other processes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class InProcessSyncer:
    """`WeightSyncer` for engines in this process: gather full weights from rank 0, load them."""

    def __init__(self, ranks: Any, engines: Iterable[Any], *, timeout_s: float = 600.0):
        self.ranks = ranks
        """The trainer's `RankGroup` (its ``call("full_state_dict")`` returns rank 0's weights first)."""
        self.engines = list(engines)
        if not self.engines:
            raise ValueError("InProcessSyncer needs at least one engine")
        self.timeout_s = timeout_s
        self.version = max(e.version for e in self.engines)

    async def sync(self) -> int:
        """Load the trainer's current weights into every engine; return the new version."""
        full = (await self.ranks.call("full_state_dict", timeout=self.timeout_s, setting="timeout_s"))[0]
        self.version += 1
        for engine in self.engines:
            names = {name for name, _, _ in engine.param_meta()}
            await engine.pause("keep", clear_cache=False)
            try:
                await engine.load_weights([(k, v) for k, v in full.items() if k in names])
                await engine.finish_weight_update(self.version)
            finally:
                await engine.resume()
        return self.version
