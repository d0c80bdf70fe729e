"""`DirectEngineSyncer`: a `WeightSyncer` for engines in the Trainer's own process.

It gathers the full state dict from rank 0 and copies it in-process
(``pause("keep") -> load_weights -> finish_weight_update -> resume``): fine for one local
engine and the tiny model; `asyncrl.sync` is the bucketed broadcast path for real engines.

The synchronous, on-policy training loop that used to live here is now ``python -m
asyncrl.launch --mode sync`` (`asyncrl.modes`): the same engine actors, trainer ranks,
coordinator, dataset and reward as the asynchronous run, in lockstep.
"""

from __future__ import annotations

from asyncrl.trainer.ranks import RankGroup


class DirectEngineSyncer:
    """`WeightSyncer` for engines in this process: gather full weights from rank 0, load them."""

    def __init__(self, ranks: RankGroup, engines, *, timeout_s: float = 600.0):
        self.ranks = ranks
        self.engines = list(engines)
        self.timeout_s = timeout_s
        self.version = max(e.version for e in self.engines)

    async def sync(self) -> int:
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
