"""The engine's half of the ``vllm`` backend: the engine actor drives vLLM's workers through its ``AsyncLLM``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from asyncrl.sync.base import ReceiverInit
from asyncrl.sync.vllm.config import check_join_timeout
from asyncrl.sync.wire import VLLMWeightSyncError


class VLLMWeightReceiver:
    """The engine's side (`asyncrl.sync.base.WeightReceiver`) inside a `VLLMEngine`'s actor.

    vLLM's workers do the receiving; this drives them through the engine's ``AsyncLLM``:
    `connect` -> ``init_weight_transfer_engine``; `receive` -> ``start_weight_update``,
    ``update_weights`` (while the trainer broadcasts), then the engine's
    ``finish_weight_update(version)``. Every call runs under a deadline taken from the init
    record: the rendezvous under ``join_timeout_s`` (`WeightSyncConfig.connect_timeout_s`), each
    update step under ``timeout_s`` (``transfer_timeout_s``).

    When a step fails or runs out of time, vLLM's worker may still be inside it (blocked in the
    rendezvous or a broadcast), and its later calls would queue behind it: the engine is marked
    broken (it refuses ``resume()`` and every later weight call, naming why) and must be rebuilt.
    It never serves half-loaded weights.
    """

    def __init__(self, engine, init_info: dict, *, join_timeout_s: float, timeout_s: float) -> None:
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in init_info]
        if missing:
            raise ValueError(f"vLLM init info is missing {missing}: pass this engine's ReceiverInit")
        check_join_timeout(join_timeout_s, "join_timeout_s (WeightSyncConfig.connect_timeout_s)")
        self.engine = engine
        self.init_info = dict(init_info)
        self.join_timeout_s = join_timeout_s
        self.timeout_s = timeout_s

    @classmethod
    def from_init(cls, engine, init: ReceiverInit) -> VLLMWeightReceiver:
        g = init.group
        info = {"master_address": g.master_addr, "master_port": g.master_port, "rank_offset": init.rank_offset,
                "world_size": g.world_size, **init.options}
        return cls(engine, info, join_timeout_s=g.join_timeout_s or g.timeout_s, timeout_s=g.timeout_s)

    async def connect(self) -> None:
        """Join the trainer's NCCL group; returns when the trainer has joined too."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._check_usable("init_weight_sync")
        info = dict(self.init_info)
        if _vllm_series() < (0, 33) and info.get("packed_num_buffers", 1) > 1:
            # vLLM 0.32's packed receiver may unpack a tensor split over two buckets before the
            # second bucket landed when it cycles several buffers (0.33 orders them with events)
            info["packed_num_buffers"] = 1
        request = WeightTransferInitRequest(init_info=info)
        await self._step(self.engine.llm.init_weight_transfer_engine(request), "init_weight_transfer_engine",
                         self.join_timeout_s, "connect_timeout_s")

    async def receive(self, *, version: int, names: Sequence[str] = (), dtype_names: Sequence[str] = (),
                      shapes: Sequence[Sequence[int]] = ()) -> None:
        """Receive one full set of weights while paused, as the trainer's ``send`` broadcasts it,
        and commit it as ``version``. Empty lists reuse the metadata of the last update."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        engine = self.engine
        if engine.paused is None:
            raise VLLMWeightSyncError("receive_weights while serving: pause(mode='keep') first")
        self._check_usable("receive_weights")
        if not len(names) == len(dtype_names) == len(shapes):
            raise ValueError(
                f"receive_weights: names, dtype_names and shapes differ in length "
                f"({len(names)}, {len(dtype_names)}, {len(shapes)})"
            )
        info = {"names": list(names), "dtype_names": list(dtype_names), "shapes": [list(x) for x in shapes]}
        # Until finish_weight_update succeeds the model may hold a mix of old and new tensors.
        engine.weights_broken = "a weight update started and did not finish; rebuild the engine"
        await self._step(engine.llm.start_weight_update(), "start_weight_update", self.timeout_s, "transfer_timeout_s")
        engine.weight_update_open = True
        await self._step(engine.llm.update_weights(WeightTransferUpdateRequest(update_info=info)), "update_weights",
                         self.timeout_s, "transfer_timeout_s")
        await self._step(engine.finish_weight_update(version), "finish_weight_update", self.timeout_s,
                         "transfer_timeout_s")

    def close(self) -> None:
        """Nothing to release here: vLLM's worker owns the group (it lives as long as the engine)."""

    def _check_usable(self, what: str) -> None:
        self.engine.check_open()
        if self.engine.weights_broken is not None:
            # vLLM's worker may still be inside the failed step (e.g. blocked in NCCL): fail fast.
            raise VLLMWeightSyncError(f"{what}: {self.engine.weights_broken}")

    async def _step(self, awaitable, what: str, timeout_s: float, setting: str):
        try:
            return await asyncio.wait_for(awaitable, timeout_s)
        except TimeoutError:
            self.engine.weights_broken = (f"vLLM {what} did not finish within WeightSyncConfig.{setting}={timeout_s}s; "
                                          "its worker may still be inside it: rebuild the engine")
            raise VLLMWeightSyncError(self.engine.weights_broken) from None
        except VLLMWeightSyncError:
            raise
        except Exception as exc:
            self.engine.weights_broken = f"vLLM {what} failed ({exc}); rebuild the engine"
            raise VLLMWeightSyncError(self.engine.weights_broken) from exc


def _vllm_series() -> tuple[int, int]:
    """(major, minor) of the installed vLLM."""
    from vllm import __version__

    major, minor = __version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
