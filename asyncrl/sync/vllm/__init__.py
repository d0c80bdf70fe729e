"""The ``vllm`` weight-sync backend: vLLM's NCCL weight-transfer engine, both halves (vLLM 0.32 and 0.33, GPU).

vLLM engines receive weights through vLLM's own transfer engine
(``weight_transfer_config={"backend": "nccl"}``), not through asyncrl's `WeightSyncGroup`:
their workers join a group that vLLM builds (a ``StatelessProcessGroup`` over a TCPStore
plus a ``PyNcclCommunicator``), which a torch.distributed group cannot join. The facts this
relies on, read from vLLM 0.33.0's
``distributed/weight_transfer/{nccl_engine,nccl_common,packed_tensor}.py``:

- Group: trainer rank 0 is NCCL rank 0 and hosts the TCPStore at
  ``master_address:master_port``. A worker of an engine sits at
  ``rank_offset + dp_rank * (tp * pp) + rank_in_dp``; ``world_size`` = 1 + every worker.
  Each engine (one ``AsyncLLM``) gets its own ``rank_offset`` (`engine_init_infos`).
- Handshake (once): every engine runs ``init_weight_transfer_engine(init_info)`` while
  trainer rank 0 runs `VLLMWeightSender.connect`; both block in the same rendezvous.
- Update (each sync): engines run ``start_weight_update``, then
  ``update_weights({names, dtype_names, shapes})`` *while* the trainer broadcasts, then
  ``finish_weight_update``. `VLLMWeightSender.update_kwargs` sends the full names/dtypes/
  shapes every sync: vLLM 0.33 reads empty lists as "same as last time", 0.32 does not.
  On 0.32 the engines unpack with one buffer (its packed receiver has no ordering between
  buffers); 0.33 takes ``packed_num_buffers`` as sent.
- Packed geometry (`plan_vllm_buckets`): tensors in metadata order, raw bytes, no padding;
  a bucket closes right after the tensor that takes its total past
  ``packed_buffer_size_bytes`` (that tensor included), or at the end. One NCCL broadcast
  per bucket from rank 0. Both sides derive the same cut points from the same metadata.

Both halves live in this package: `sender.VLLMWeightSender` (every trainer rank) and
`receiver.VLLMWeightReceiver` (the engine actor, driving its ``AsyncLLM``); `protocol` holds what
both agree on (tensor metadata, bucket geometry, vLLM's init/update records, the packing) and
`config` the trainer's settings. `asyncrl.sync.coordinator.WeightSyncCoordinator` runs them
with ``WeightSyncConfig(method="vllm")``::

    trainer ranks:  init_weight_sync(SenderInit)   # rank 0 returns one ReceiverInit per engine
    engine i:       init_weight_sync(ReceiverInit) # init_weight_transfer_engine; joins the group
    each sync:      every engine: pause(mode="keep", clear_cache=False)
                    kw = rank 0's weight_update_kwargs(version=v + 1)
                    concurrently: every engine receive_weights(version=v + 1, **kw); every trainer rank send_weights
                    every engine: resume()

Deadlines are the coordinator's settings: the rendezvous waits ``connect_timeout_s`` on both
sides (the trainer builds vLLM's ``StatelessProcessGroup`` itself with that store timeout; the
engines' workers wait vLLM's fixed 300 s, so a longer setting is refused), each update step
``transfer_timeout_s``. Weights travel in ``WeightSyncConfig.wire_dtype`` (the engine's dtype
by default: bf16 halves fp32's bytes). A failed or timed-out step is not retried into a vLLM
engine: its worker may still be inside the step, so the engine stays paused, refuses every
later weight call and ``resume()`` (it never serves half-loaded weights; rebuild it).

Leaves out: the unique-id (torch-free) rendezvous, CUDA-IPC (colocated) transfer, the
sparse and m2n backends, and sending from more than one trainer rank. What was checked
against vLLM 0.33.0's source and what only a GPU run can confirm: docs/vllm.md. The
geometry, packing, deadlines and failure paths are tested on CPU with stand-ins for vLLM.
"""

from asyncrl.sync.vllm.config import VLLMSyncConfig, check_join_timeout
from asyncrl.sync.vllm.protocol import (
    TensorMeta,
    broadcast_packed,
    check_vllm_alignment,
    engine_init_infos,
    iter_full_tensors,
    model_tensor_metas,
    plan_vllm_buckets,
    update_info,
)
from asyncrl.sync.vllm.receiver import VLLMWeightReceiver
from asyncrl.sync.vllm.sender import VLLMWeightSender
from asyncrl.sync.wire import VLLMWeightSyncError

__all__ = [
    "TensorMeta",
    "VLLMSyncConfig",
    "VLLMWeightReceiver",
    "VLLMWeightSender",
    "VLLMWeightSyncError",
    "broadcast_packed",
    "check_join_timeout",
    "check_vllm_alignment",
    "engine_init_infos",
    "iter_full_tensors",
    "model_tensor_metas",
    "plan_vllm_buckets",
    "update_info",
]
