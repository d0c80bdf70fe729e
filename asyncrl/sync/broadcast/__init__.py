"""The ``broadcast`` backend: asyncrl's own weight-sync group, both halves.

`BroadcastSender` (`sender`) runs in every trainer rank, `BroadcastReceiver` (`receiver`) in an
engine actor; they meet in a `asyncrl.sync.group.WeightSyncGroup` and move buckets laid out by
`asyncrl.sync.buckets`. `asyncrl.sync.backends.make_sender` / ``make_receiver`` build them from
the coordinator's `SenderInit` / `ReceiverInit`.

Wire protocol on the group, per sync (all from rank 0):

1. header: int64 ``[MAGIC, version, meta_nbytes, num_buckets]``;
2. if ``meta_nbytes > 0``: the msgpack `BucketLayout` as uint8 (sent on the first sync of
   a group and whenever names/dtypes/shapes/bucket size change, otherwise 0);
3. one uint8 tensor per bucket, laid out as `asyncrl.sync.buckets` says.

LoRA (``trainer.lora.rank`` > 0): the sender carries only the adapters, in the same buckets
and protocol, and tells the receivers their spec in ``ReceiverInit.options["lora"]``; a
receiver then loads into a `asyncrl.sync.lora.LoraMerger` around its engine, which merges them
onto its kept copy of the base weights when the sync completes.
"""

from asyncrl.sync.broadcast.receiver import BroadcastReceiver
from asyncrl.sync.broadcast.sender import BroadcastSender

__all__ = ["BroadcastReceiver", "BroadcastSender"]
