"""Trainer: FSDP2 ranks on Ray, fail-closed batch assembly, GRPO/PPO losses, acks, checkpoints.

- `config`: `TrainerConfig` (driver loop), `WorkerConfig` (one rank), `AlgorithmConfig`, `OptimConfig`;
- `algorithm`: advantages and the policy loss; `batch`: Groups -> TensorDict, fail closed;
- `fsdp`: ``parallelize(model, mesh)``; `worker`: `TrainerWorker` (one rank); `ranks`: `RankGroup`;
- `trainer`: `Trainer` (the driver loop); it takes a `GroupSource` (`asyncrl.queue`) and a
  `WeightSyncer` (`asyncrl.sync`), re-exported here with `MemorySource`;
- `checkpoint`: DCP shards + JSON sidecar. The on-policy lockstep is the launcher's ``--mode sync``
  (`asyncrl.modes`), with every process of an async run; this package imports neither the
  Rollouter nor the tasks.

Names are imported lazily so ``import asyncrl.trainer`` stays cheap (no torch until used).
"""

from __future__ import annotations

from asyncrl._lazy import lazy_exports

_EXPORTS = {
    "AlgorithmConfig": "asyncrl.trainer.config",
    "OptimConfig": "asyncrl.trainer.config",
    "TrainerConfig": "asyncrl.trainer.config",
    "WorkerConfig": "asyncrl.trainer.config",
    "LoraConfig": "asyncrl.trainer.config",
    "IncompleteGroupError": "asyncrl.trainer.batch",
    "assemble": "asyncrl.trainer.batch",
    "parallelize": "asyncrl.trainer.fsdp",
    "TrainerWorker": "asyncrl.trainer.worker",
    "RankGroup": "asyncrl.trainer.ranks",
    "Trainer": "asyncrl.trainer.trainer",
    "GroupSource": "asyncrl.queue.base",
    "WeightSyncer": "asyncrl.sync.base",
    "MemorySource": "asyncrl.queue.memory",
    "StepResult": "asyncrl.trainer.trainer",
    "TrainerState": "asyncrl.trainer.checkpoint",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
