"""`WeightSyncGroup`: a torch.distributed process group of its own, outside the training world.

Rank 0 is trainer rank 0, ranks 1..N are the engine workers. Rank 0 hosts the rendezvous
`TCPStore` on a socket it binds itself (``master_addr``, port 0 = any free port), so the
port is known before anyone joins and the store listens only on that address. The backend
object (`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on CUDA) is built directly on a
`PrefixStore`: nothing here touches ``torch.distributed``'s default group, so a trainer
rank keeps its FSDP2 world and an engine keeps whatever it has.

Joining blocks until every rank has joined (that is the backend's rendezvous); it runs
under ``timeout_s``, which is also the deadline of every collective on the group.
Leaves out: several groups sharing one store, re-joining a broken group (build a new one
under a new ``group_name``).
"""

from __future__ import annotations

import datetime
import ipaddress
import socket

import torch
import torch.distributed as dist

from asyncrl.sync.base import GroupInit


class WeightSyncGroup:
    """One member of the weight-sync group. Rank 0 calls `listen()` then `join()`; others `join()`."""

    def __init__(self, config: GroupInit, rank: int) -> None:
        if not 0 <= rank < config.world_size:
            raise ValueError(f"rank must be in [0, {config.world_size}), got {rank}")
        self.config = config
        self.rank = rank
        self.backend = config.resolved_backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self._store: dist.Store | None = None
        self._pg = None
        self._closed = False
        self.port = config.master_port

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.config.timeout_s)

    def listen(self) -> int:
        """Rank 0: bind the rendezvous socket and host the store; return the port."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 hosts the weight-sync store")
        if self._store is None:
            family = socket.AF_INET6 if _is_ipv6(self.config.master_addr) else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.config.master_addr, self.config.master_port))
            sock.listen(128)
            self.port = sock.getsockname()[1]
            try:
                self._store = dist.TCPStore(
                    self.config.master_addr, self.port, self.config.world_size, True, self.timeout,
                    wait_for_workers=False, master_listen_fd=sock.fileno(),
                )
            except BaseException:
                sock.close()
                raise
            sock.detach()  # the store's server owns the descriptor now and closes it
        return self.port

    def join(self) -> None:
        """Rendezvous and build the backend group; blocks until every rank joined (under ``timeout_s``)."""
        if self._pg is not None:
            return
        if self._closed:
            raise RuntimeError("weight-sync group is closed; build a new one")
        if self._store is None:
            if self.rank == 0:
                self.listen()
            else:
                if self.port == 0:
                    raise ValueError("master_port must be the port rank 0 reported (got 0) on ranks > 0")
                self._store = dist.TCPStore(
                    self.config.master_addr, self.port, self.config.world_size, False, self.timeout
                )
        store = dist.PrefixStore(self.config.group_name, self._store)
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            opts._devices = [_gloo_device(self.config.master_addr)]
            pg = dist.ProcessGroupGloo(store, self.rank, self.config.world_size, opts)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            pg = dist.ProcessGroupNCCL(store, self.rank, self.config.world_size, opts)
        if self._closed:  # closed while we were waiting for the others: do not come back to life
            raise RuntimeError("weight-sync group was closed while joining")
        self._pg = pg

    @property
    def joined(self) -> bool:
        return self._pg is not None

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Start a broadcast of ``tensor`` from ``src``; returns the backend's Work (``.wait()`` it)."""
        if self._pg is None:
            raise RuntimeError("weight-sync group not joined yet: call join() first")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self.timeout
        return self._pg.broadcast([tensor], opts)

    def close(self) -> None:
        """Drop the backend group (its destruction closes the sockets, so peers fail fast) and the store.

        Does not wait for a join in progress (it ends at ``timeout_s`` and then finds the group closed).
        """
        self._closed = True
        pg, self._pg = self._pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - best effort: the group may already be broken
                pass
        self._store = None


def _is_ipv6(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).version == 6
    except ValueError:
        return False


def _gloo_device(master_addr: str):
    # On loopback every rank is on this machine: pin gloo to it so no rank advertises an
    # address the others cannot reach. Elsewhere let gloo pick this host's interface.
    try:
        loopback = ipaddress.ip_address(master_addr).is_loopback
    except ValueError:
        loopback = master_addr == "localhost"
    if loopback:
        return dist.ProcessGroupGloo.create_device(hostname=master_addr)
    return dist.ProcessGroupGloo.create_default_device()
