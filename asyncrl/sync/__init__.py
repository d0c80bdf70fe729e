"""Weight sync: a process group outside the training world, bucketed broadcast, pause-keep coordinator.

- `WeightSyncGroup` (`group`): rank 0 = trainer rank 0, ranks 1..N = engine workers; gloo on
  CPU, nccl on CUDA, built beside each process's default group.
- `WeightSender` (`sender`, in a trainer rank) and `WeightReceiver` (`receiver`, in an engine
  actor): metadata once, then packed uint8 buckets (`buckets`).
- `WeightSyncCoordinator` (`coordinator`): pause keep -> broadcast -> load -> resume ->
  version += 1 on every engine, each step under a named timeout.

Names are imported lazily so ``import asyncrl.sync`` stays cheap.
"""

from __future__ import annotations

from asyncrl._lazy import lazy_exports

_EXPORTS = {
    "WeightSyncGroup": "asyncrl.sync.group",
    "SyncGroupConfig": "asyncrl.sync.group",
    "WeightSender": "asyncrl.sync.sender",
    "WeightSyncError": "asyncrl.sync.sender",
    "WeightReceiver": "asyncrl.sync.receiver",
    "BucketLayout": "asyncrl.sync.buckets",
    "plan_buckets": "asyncrl.sync.buckets",
    "WeightSyncCoordinator": "asyncrl.sync.coordinator",
    "WeightSyncConfig": "asyncrl.sync.config",
    "WeightSyncer": "asyncrl.sync.coordinator",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
