"""The trainer's ranks as one handle: start them, call a method on every rank, stop them.

Two backends behind one interface, so unit tests need no processes:

- `RankGroup.start_ray`: one Ray actor per rank (``ray.remote(TrainerWorker)``), all joined in
  one torch.distributed world (``gloo`` on CPU, ``nccl`` on CUDA) rendezvousing on a free
  loopback port;
- `RankGroup.start_local`: a single rank in this process (world size 1), run in a worker
  thread so the caller's event loop keeps serving its sockets.

Every call has a deadline whose error names the setting that bounds it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from asyncrl.net import free_port
from asyncrl.trainer.config import TrainerConfig
from asyncrl.trainer.worker import TrainerWorker


class PortBox:
    """Rank 0 puts the store address it bound; the other ranks get it (a small Ray actor)."""

    def __init__(self) -> None:
        self._address: tuple[str, int] | None = None
        self._set = asyncio.Event()

    async def put(self, addr: str, port: int) -> None:
        self._address = (addr, port)
        self._set.set()

    async def get(self) -> tuple[str, int]:
        await self._set.wait()
        return self._address


class RankGroup:
    """Owns the trainer ranks; `call` runs one method on every rank and gathers the results."""

    def __init__(self, workers: Sequence[Any], *, remote: bool):
        self.workers = list(workers)
        self.remote = remote
        self.world_size = len(self.workers)

    @classmethod
    def start_ray(cls, cfg: TrainerConfig, actor_options: Sequence[dict] | None = None,
                  across_nodes: bool = False) -> RankGroup:
        """Start ``cfg.world_size`` rank actors on the connected Ray cluster and wait until all are up.

        ``actor_options[r]`` (Ray actor options, e.g. a placement-group bundle) places rank ``r``;
        without them each rank reserves ``cpus_per_rank`` / ``gpus_per_rank`` anywhere. The ranks
        rendezvous on loopback, or with ``across_nodes`` at a store rank 0 binds on its node's
        address (`asyncrl.trainer.worker.bound_store`).
        """
        import ray

        port = 0 if across_nodes or cfg.world_size == 1 else free_port()  # one rank needs no rendezvous
        box = ray.remote(PortBox).options(num_cpus=0).remote() if across_nodes else None
        default = {"num_cpus": cfg.cpus_per_rank, "num_gpus": cfg.gpus_per_rank}
        options = list(actor_options) if actor_options is not None else [default] * cfg.world_size
        if len(options) != cfg.world_size:
            raise ValueError(f"actor_options has {len(options)} entries for world_size={cfg.world_size}")
        workers = [
            ray.remote(TrainerWorker).options(**options[r]).remote(
                cfg.worker, rank=r, world_size=cfg.world_size, master_port=port,
                init_timeout_s=cfg.rank_start_timeout_s, rendezvous=box)
            for r in range(cfg.world_size)
        ]
        group = cls(workers, remote=True)
        try:
            ray.get([w.ready.remote() for w in workers], timeout=cfg.rank_start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            group.close()
            raise TimeoutError(f"trainer ranks not up within rank_start_timeout_s={cfg.rank_start_timeout_s}") from None
        except BaseException:
            group.close()
            raise
        return group

    @classmethod
    def start_local(cls, cfg: TrainerConfig) -> RankGroup:
        """One rank in this process; ``cfg.world_size`` must be 1."""
        if cfg.world_size != 1:
            raise ValueError(f"start_local runs one rank; world_size must be 1, got {cfg.world_size}")
        return cls([TrainerWorker(cfg.worker, rank=0, world_size=1, master_port=0,  # one rank: no rendezvous
                                  init_timeout_s=cfg.rank_start_timeout_s)], remote=False)

    async def call(self, method: str, per_rank: Sequence[tuple] | None = None, *, timeout: float,
                   setting: str = "step_timeout_s", **kwargs) -> list[Any]:
        """Run ``method`` on every rank (rank r gets ``*per_rank[r]`` then ``**kwargs``); results by rank."""
        args = per_rank if per_rank is not None else [()] * self.world_size
        if len(args) != self.world_size:
            raise ValueError(f"{method}: {len(args)} argument tuples for {self.world_size} ranks")
        if self.remote:
            refs = [getattr(w, method).remote(*a, **kwargs) for w, a in zip(self.workers, args)]
            pending = asyncio.gather(*[asyncio.wrap_future(r.future()) for r in refs])
        else:
            pending = asyncio.to_thread(getattr(self.workers[0], method), *args[0], **kwargs)
            pending = asyncio.gather(pending)
        try:
            return await asyncio.wait_for(pending, timeout)
        except TimeoutError:
            raise TimeoutError(f"trainer ranks did not finish {method} within {setting}={timeout}") from None

    def call_sync(self, method: str, per_rank: Sequence[tuple] | None = None, *, timeout: float,
                  setting: str = "step_timeout_s", **kwargs) -> list[Any]:
        """`call` for code without an event loop."""
        return asyncio.run(self.call(method, per_rank, timeout=timeout, setting=setting, **kwargs))

    def close(self) -> None:
        """Stop every rank (Ray actors are killed; the local rank leaves its process group)."""
        if self.remote:
            import ray

            for w in self.workers:
                ray.kill(w)
        else:
            for w in self.workers:
                w.shutdown()
        self.workers = []
