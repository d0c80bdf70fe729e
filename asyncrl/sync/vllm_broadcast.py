"""The ``broadcast`` backend into vLLM engines: asyncrl's own group, received inside vLLM's workers.

vLLM's model lives in its worker processes (spawned by vLLM's EngineCore), not in the engine
actor, and vLLM ships no weight-transfer engine that runs without CUDA. So asyncrl puts its
own receiving half into every worker: `AsyncrlWorkerExtension` is vLLM's
``worker_extension_cls`` (vLLM mixes it into its ``Worker`` class, so its methods run in the
worker and are called by name through ``AsyncLLM.collective_rpc``). The sending half is the
ordinary `asyncrl.sync.broadcast.BroadcastSender` in the trainer: the same group (gloo on CPU,
nccl on CUDA), the same header / metadata / bucket protocol, the same coordinator, as for the
built-in engine.

Per sync, in the worker (`AsyncrlWorkerExtension.asyncrl_receive_weights`):

1. a `BroadcastReceiver` takes the header, the metadata (checked against the checkpoint's tensor
   names and shapes: what vLLM's ``load_weights`` maps) and every bucket off the group, copying
   each tensor out of the reused bucket buffers into a staging list;
2. only once every bucket has landed are the weights loaded, all at once, with vLLM's
   ``reload_weights(weights_iterator=...)``, which restores each layer, loads it and runs its
   ``process_weights_after_loading`` again (on CPU that repacks every linear for vLLM's GEMM
   kernels and leaves the parameter empty);
3. on CPU, a layer that kept its weight beside a packed copy (the embedding, whose packed copy
   is the tied LM head) is repacked again (`repack_cpu_kept_weights`): ``reload_weights`` reloads
   the weight but leaves that copy as it was, so the LM head would go on with the old weights.

So a transfer that fails part way leaves the model untouched (nothing was loaded yet), and an
update is never half applied. The engine actor side, `VLLMBroadcastReceiver`, drives those
calls and then labels the version in vLLM's EngineCore (``update_weight_version``), so vLLM's
``weight_versions`` give each token's version as with vLLM's own transfer engine.

Costs and limits: one staged copy of the weights in each worker while a sync lands (on GPU,
GPU memory; use ``WeightSyncConfig(method="vllm")``, vLLM's NCCL engine, where that does not
fit). With tensor parallelism every worker of an engine is a rank of the group and receives the
full tensors (``load_weights`` takes each worker's shard). The vLLM internals this leans on
(``reload_weights``, ``dispatch_cpu_unquantized_gemm``) are pinned by
``tests/integration/test_vllm_real.py``, which checks the engine's log-probs against the
trainer's weights after every load.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import time
from dataclasses import asdict
from pathlib import Path

import torch

from asyncrl.sync.base import GroupInit, ReceiverInit
from asyncrl.sync.wire import WeightSyncError

WORKER_EXTENSION = "asyncrl.sync.vllm_broadcast.AsyncrlWorkerExtension"
"""What asyncrl passes as vLLM's ``worker_extension_cls``."""

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def checkpoint_param_meta(model_dir: str | Path) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """Name, dtype and shape of every tensor in a model directory's safetensors files, sorted by name.

    These are the checkpoint-format names vLLM's ``load_weights`` accepts (what the trainer
    sends), read from the file headers without loading a tensor.
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    meta = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{f.name}: tensor {name!r} has dtype {info['dtype']}, which asyncrl does not sync")
            meta[name] = (name, _SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]))
    return [meta[k] for k in sorted(meta)]


def repack_cpu_kept_weights(model: torch.nn.Module) -> int:
    """Repack, from its reloaded weight, every CPU layer that keeps its weight beside a packed
    copy for vLLM's GEMM kernels (``remove_weight=False``: the embedding, whose packed copy is
    the tied LM head). Layers whose weight was moved into the packed copy (the linears, left with
    an empty parameter) were repacked by ``reload_weights`` itself. Returns how many were repacked."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    n = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            n += 1
    return n


class _StagedWeights:
    """The engine a `BroadcastReceiver` loads into, inside a vLLM worker: received tensors are
    staged, and loaded into vLLM's model in one ``reload_weights`` when the sync completes."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.staged: list[tuple[str, torch.Tensor]] = []
        self.stats: dict = {}

    def param_meta(self):
        return checkpoint_param_meta(self.worker.vllm_config.model_config.model)

    async def load_weights(self, named_tensors) -> None:
        # views into the receiver's reused bucket buffers: copy them out
        self.staged.extend((name, t.clone()) for name, t in named_tensors)

    async def finish_weight_update(self, version: int) -> None:
        weights, self.staged = self.staged, []
        start = time.perf_counter()
        # vLLM warns, per layer and per load, about layers the checkpoint has no tensor for (the
        # rotary embedding, a tied LM head): expected here, and the log-prob tests check the result
        quiet = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            self.worker.reload_weights(weights_iterator=iter(weights))
        finally:
            quiet.setLevel(level)
        repacked = 0
        if self.worker.device.type == "cpu":
            repacked = repack_cpu_kept_weights(self.worker.model_runner.get_model())
        self.stats = {"load_s": time.perf_counter() - start, "tensors": len(weights), "repacked": repacked}


class AsyncrlWorkerExtension:
    """vLLM ``worker_extension_cls``: asyncrl's weight receiver inside each vLLM worker.

    vLLM adds these methods to its ``Worker`` class (names must not clash with the Worker's
    own, hence the ``asyncrl_`` prefix); ``AsyncLLM.collective_rpc(name, kwargs=...)`` runs
    them in every worker and returns each worker's result.
    """

    def asyncrl_join_weight_sync(self, *, group: dict, rank_offset: int, lora: dict | None = None) -> dict:
        """Join asyncrl's weight-sync group as rank ``rank_offset + this worker's rank`` (blocks
        until every rank joined, under the group's ``timeout_s``). With ``lora`` (the adapters'
        spec) the adapters received are merged onto a kept copy of the base (`asyncrl.sync.lora`)
        and the merged weights go through the same staged ``reload_weights``."""
        from asyncrl.sync.broadcast import BroadcastReceiver
        from asyncrl.sync.lora import LoraMerger

        self.asyncrl_close_weight_sync()
        self._asyncrl_staged = _StagedWeights(self)
        target = self._asyncrl_staged
        if lora is not None:
            # siblings: vLLM reloads a fused layer (qkv_proj, gate_up_proj) whole
            target = LoraMerger(target, lora, self.vllm_config.model_config.model, siblings=True)
        # a bucket landing straight in a parameter would be live before the sync completes
        self._asyncrl_receiver = BroadcastReceiver(target, rank_offset=rank_offset + self.rank,
                                                   direct=False, **group)
        return asyncio.run(self._asyncrl_receiver.connect())

    def asyncrl_receive_weights(self, *, version: int) -> dict:
        """Receive one full set of weights, then load it into the model (see the module doc)."""
        receiver = getattr(self, "_asyncrl_receiver", None)
        if receiver is None:
            raise WeightSyncError("asyncrl_receive_weights before asyncrl_join_weight_sync")
        self._asyncrl_staged.staged = []  # what a failed sync left
        try:
            stats = asyncio.run(receiver.receive(version=version))
        finally:
            self._asyncrl_staged.staged = []
        return {**stats, **self._asyncrl_staged.stats}

    def asyncrl_close_weight_sync(self) -> None:
        """Leave the group (safe to call twice)."""
        receiver = getattr(self, "_asyncrl_receiver", None)
        self._asyncrl_receiver = None
        if receiver is not None:
            receiver.close()


class VLLMBroadcastReceiver:
    """The engine actor's half: drives `AsyncrlWorkerExtension` in a `VLLMEngine`'s workers."""

    def __init__(self, engine, *, rank_offset: int, group: GroupInit, lora: dict | None = None) -> None:
        self.engine = engine
        self.rank_offset = rank_offset
        self.group = group
        self.lora = lora
        """The adapters' spec under LoRA sync (the workers merge them), else None."""
        # the worker's own deadlines are the group's; this one only covers the RPC around them
        self.timeout_s = group.timeout_s + 30.0

    @classmethod
    def from_init(cls, engine, init: ReceiverInit) -> VLLMBroadcastReceiver:
        """Build from this engine's `ReceiverInit` (``method="broadcast"``)."""
        return cls(engine, rank_offset=init.rank_offset, group=init.group, lora=init.options.get("lora"))

    async def connect(self) -> list[dict]:
        """Every worker of the engine joins the group."""
        self.engine.check_open()
        return await self._rpc("asyncrl_join_weight_sync", group=asdict(self.group), rank_offset=self.rank_offset,
                               lora=self.lora)

    async def receive(self, *, version: int) -> dict:
        """Receive and load one full set of weights in every worker, then make it live as ``version``."""
        engine = self.engine
        if engine.paused is None:
            raise WeightSyncError("receive_weights on a running vLLM engine: pause it (keep) first")
        start = time.perf_counter()
        try:
            per_worker = await self._rpc("asyncrl_receive_weights", version=version)
        except BaseException as exc:
            # the worker loads only after the last bucket: a failure before that leaves the old
            # weights whole, one during the load does not; the caller cannot tell which, so the
            # engine is resumed only after a later complete sync
            engine.weights_broken = f"weight sync to version {version} failed in vLLM's worker: {exc}"
            raise
        await engine.commit_version(version)
        return {**per_worker[0], "workers": len(per_worker), "receive_s": time.perf_counter() - start}

    async def _rpc(self, method: str, **kwargs) -> list:
        try:
            return await asyncio.wait_for(self.engine.llm.collective_rpc(method, kwargs=kwargs), self.timeout_s)
        except TimeoutError:
            raise WeightSyncError(f"vLLM worker call {method} did not return within {self.timeout_s:g}s "
                                  "(WeightSyncConfig.transfer_timeout_s + 30 s)") from None
        except WeightSyncError:
            raise
        except Exception as exc:  # noqa: BLE001 - name the step
            raise WeightSyncError(f"vLLM worker call {method} failed: {exc}") from exc

    async def close(self) -> None:
        if not self.engine.closed:
            try:
                await self._rpc("asyncrl_close_weight_sync")
            except WeightSyncError:
                pass  # the engine is going away; its workers drop the group with it
