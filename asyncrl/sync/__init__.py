"""Weight sync: one interface (`base`), one file per backend, the coordinator that drives them.

- `base`: the `WeightSyncer` / `WeightSender` / `WeightReceiver` protocols, the typed init
  records (`SenderInit`, `ReceiverInit`, `GroupInit`);
- `backends`: `make_sender` / `make_receiver`, the one place a backend is chosen;
- `wire`: wire constants, dtype names and errors both halves import;
- backends: `broadcast` (`BroadcastSender` / `BroadcastReceiver` over a `WeightSyncGroup`
  (`group`) with packed uint8 buckets (`buckets`); gloo on CPU, nccl on CUDA),
  `vllm_broadcast` (the same broadcast received inside vLLM's worker processes), `vllm`
  (vLLM's NCCL weight-transfer engine, both halves), `inprocess` (`InProcessSyncer`);
- `coordinator`: `WeightSyncCoordinator`, pause keep -> transfer -> load -> resume ->
  version += 1 on every engine, each step under a named timeout; the backend is
  ``WeightSyncConfig.method``.

Names are imported lazily so ``import asyncrl.sync`` stays cheap.
"""

from __future__ import annotations

from asyncrl._lazy import lazy_exports

_EXPORTS = {
    "WeightSyncer": "asyncrl.sync.base",
    "WeightSender": "asyncrl.sync.base",
    "WeightReceiver": "asyncrl.sync.base",
    "SenderInit": "asyncrl.sync.base",
    "ReceiverInit": "asyncrl.sync.base",
    "GroupInit": "asyncrl.sync.base",
    "make_sender": "asyncrl.sync.backends",
    "make_receiver": "asyncrl.sync.backends",
    "WeightSyncError": "asyncrl.sync.wire",
    "WeightSyncGroup": "asyncrl.sync.group",
    "BroadcastSender": "asyncrl.sync.broadcast",
    "BroadcastReceiver": "asyncrl.sync.broadcast",
    "BucketLayout": "asyncrl.sync.buckets",
    "plan_buckets": "asyncrl.sync.buckets",
    "InProcessSyncer": "asyncrl.sync.inprocess",
    "WeightSyncCoordinator": "asyncrl.sync.coordinator",
    "WeightSyncConfig": "asyncrl.sync.config",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
