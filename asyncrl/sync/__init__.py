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

import importlib

_EXPORTS = {
    "WeightSyncGroup": "asyncrl.sync.group",
    "SyncGroupConfig": "asyncrl.sync.group",
    "WeightSender": "asyncrl.sync.sender",
    "WeightSyncError": "asyncrl.sync.sender",
    "WeightReceiver": "asyncrl.sync.receiver",
    "BucketLayout": "asyncrl.sync.buckets",
    "plan_buckets": "asyncrl.sync.buckets",
    "WeightSyncCoordinator": "asyncrl.sync.coordinator",
    "WeightSyncConfig": "asyncrl.sync.coordinator",
    "WeightSyncer": "asyncrl.sync.coordinator",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncrl.sync' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
