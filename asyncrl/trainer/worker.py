"""One trainer rank: an FSDP2-sharded HF causal LM, its AdamW optimizer and the loss step.

`TrainerWorker` is a plain class: `asyncrl.trainer.ranks` runs it in-process (one rank) or
wraps it with ``ray.remote`` (one actor per rank, all in one torch.distributed world). Every
rank gets its own rows of each mini-batch; the loss of each micro-batch is divided by the
mini-batch's global token (or sequence) count, so accumulating over micro-batches and
averaging over ranks gives exactly the gradient of the whole mini-batch.

The model runs in ``eval()`` mode throughout: dropout would make the recomputed log-probs
differ from the behaviour log-probs of the same weights, which the loss treats as off-policy.

With ``lora.rank`` > 0 the model is a ``peft`` LoRA model (`asyncrl.trainer.lora`): the base is
frozen, the optimizer, checkpoints and weight sync hold the adapters only.

Leaves out: sequence packing and activation checkpointing.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from tensordict import TensorDict

from asyncrl.trainer import algorithm, checkpoint, lora
from asyncrl.trainer.batch import micro_batches
from asyncrl.trainer.config import OptimConfig, WorkerConfig
from asyncrl.trainer.fsdp import parallelize


def lr_at(cfg: OptimConfig, step: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup, then constant or cosine."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def merge_stats(into: dict[str, float], stats: dict[str, float]) -> None:
    """Fold ``stats`` into ``into``: ``*_max``/``*_min`` keep the extreme, everything else adds up."""
    for k, v in stats.items():
        if k.endswith("_max"):
            into[k] = max(into.get(k, -math.inf), v)
        elif k.endswith("_min"):
            into[k] = min(into.get(k, math.inf), v)
        else:
            into[k] = into.get(k, 0.0) + v


def bound_store(rank: int, world_size: int, rendezvous, timeout: timedelta) -> dist.TCPStore:
    """The world's store on rank 0's node: rank 0 binds its node's address (a free port, taken by
    the bind itself: no probe-then-bind race) and publishes it on ``rendezvous`` (a Ray actor
    with ``put``/``get``); the other ranks wait for it there."""
    import socket

    import ray

    if rank == 0:
        addr = ray.util.get_node_ip_address()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        try:
            store = dist.TCPStore(addr, port, world_size, True, timeout, wait_for_workers=False,
                                  master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store's server owns the descriptor now
        ray.get(rendezvous.put.remote(addr, port))
        return store
    addr, port = ray.get(rendezvous.get.remote(), timeout=timeout.total_seconds())
    return dist.TCPStore(addr, port, world_size, False, timeout)


class TrainerWorker:
    """One rank of the trainer's torch.distributed world."""

    def __init__(self, cfg: WorkerConfig, *, rank: int, world_size: int, master_addr: str = "127.0.0.1",
                 master_port: int, init_timeout_s: float = 300.0, rendezvous=None):
        from asyncrl.hang import enable_stack_dumps

        enable_stack_dumps()  # the launcher's hang watchdog asks every process where it waits
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        torch.manual_seed(cfg.seed)
        if not dist.is_initialized():
            backend, timeout = "nccl" if use_cuda else "gloo", timedelta(seconds=init_timeout_s)
            if world_size == 1:
                # One rank needs no rendezvous: an in-process store, no port to pick or lose.
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            elif rendezvous is None:
                dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                        rank=rank, world_size=world_size, timeout=timeout)
            else:
                dist.init_process_group(backend, store=bound_store(rank, world_size, rendezvous, timeout),
                                        rank=rank, world_size=world_size, timeout=timeout)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(self.device.type, (world_size,))
        self.model = self._load(use_cuda)
        self.ref_model = None
        if cfg.algorithm.kl_coef > 0:
            # The reference is frozen: it anchors the KL penalty at the starting policy.
            self.ref_model = self._load(use_cuda, frozen=True)
            self.ref_model.requires_grad_(False)
        # With LoRA the base is frozen: only the adapters train, and only they hold optimizer state.
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=cfg.optim.lr, betas=cfg.optim.betas,
                                           weight_decay=cfg.optim.weight_decay)
        self.optim_steps = 0
        self._sender = None  # built by init_weight_sync

    def _load(self, mixed_precision: bool, frozen: bool = False) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.cfg.model_path, dtype=torch.float32)
        if self.cfg.lora.enabled and not frozen:
            model = lora.wrap(model, self.cfg.lora)  # before sharding: FSDP2 shards the adapters too
        model.to(self.device).eval()
        return parallelize(model, self.mesh, mixed_precision=mixed_precision)

    def ready(self) -> int:
        """Return this rank once the model is loaded and the process group is up."""
        return self.rank

    # -- forward -------------------------------------------------------------------------

    def _forward(self, model: torch.nn.Module, mb: TensorDict) -> torch.Tensor:
        mb = mb.to(self.device)
        return model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                     position_ids=mb["position_ids"], use_cache=False).logits

    @torch.no_grad()
    def compute_logprobs(self, batch: TensorDict, reference: bool = False) -> torch.Tensor:
        """Per-token log-probs [B, L] of ``batch`` (aligned like ``old_logprobs``) under the current
        weights, or the frozen reference's with ``reference``. Collective: every rank calls it."""
        model = self.ref_model if reference else self.model
        if model is None:
            raise ValueError("reference log-probs need algorithm.kl_coef > 0 (no reference model loaded)")
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        start = 0
        for mb in micro_batches(batch, self.cfg.micro_batch_size):
            logits = self._forward(model, mb)
            lp = algorithm.token_logprobs(logits, mb["input_ids"].to(self.device), self.cfg.algorithm.temperature)
            rows, width = lp.shape
            out[start:start + rows, :width] = lp.cpu() * mb["attention_mask"]
            start += rows
        return out

    # -- one optimizer step ----------------------------------------------------------------

    def train_minibatch(self, shard: TensorDict, denom: float) -> dict[str, float]:
        """Accumulate gradients over this rank's ``shard`` of a mini-batch, then one optimizer step.

        ``denom`` is the whole mini-batch's count (tokens or sequences, see `algorithm.aggregate`).
        Collective: every rank calls it with its own shard and the same ``denom``.
        """
        acfg = self.cfg.algorithm
        # Rows of like length together: a micro-batch is as wide as its longest row, so sorted rows
        # compute less padding (a third less on responses of 5-64 tokens in 16-row micro-batches).
        # The loss sums over rows divided by the mini-batch's ``denom``: the order leaves it as is.
        shard = shard[shard["attention_mask"].sum(-1).argsort(descending=True, stable=True)]
        mbs = micro_batches(shard, self.cfg.micro_batch_size)
        # Proximal and reference log-probs come from the weights *before* this update.
        prox = [self.compute_logprobs(mb) for mb in mbs] if acfg.decoupled else [None] * len(mbs)
        ref = [self.compute_logprobs(mb, reference=True) for mb in mbs] if acfg.kl_coef > 0 else [None] * len(mbs)
        totals: dict[str, float] = {"loss": 0.0, "entropy_sum": 0.0}
        lora.set_dropout(self.model, self.cfg.lora.dropout > 0)  # only this forward; log-probs run without
        for mb, prox_lp, ref_lp in zip(mbs, prox, ref):
            logits = self._forward(self.model, mb)
            mb = mb.to(self.device)
            logprobs = algorithm.token_logprobs(logits, mb["input_ids"], acfg.temperature)
            loss, stats = algorithm.policy_loss(
                logprobs, mb["old_logprobs"], mb["advantages"], mb["response_mask"], acfg, denom=denom,
                proximal_logprobs=None if prox_lp is None else prox_lp.to(self.device),
                ref_logprobs=None if ref_lp is None else ref_lp.to(self.device),
            )
            # FSDP averages gradients over ranks; the loss is already normalised by the global
            # count, so scale by world_size to turn that average back into the global sum.
            (loss * self.world_size).backward()
            with torch.no_grad():
                ent = algorithm.token_entropy(logits.detach(), acfg.temperature)
                totals["entropy_sum"] += float((ent * mb["response_mask"]).sum())
            totals["loss"] += float(loss.detach())
            merge_stats(totals, {k: float(v) for k, v in stats.items()})
        lora.set_dropout(self.model, False)
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, max_norm)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"gradient norm is {norm} at optimizer step {self.optim_steps}; "
                                     "lower optim.lr or check the batch's advantages")
        lr = lr_at(self.cfg.optim, self.optim_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optim_steps += 1
        totals.update(grad_norm=norm, lr=lr)
        return totals

    # -- state -----------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded CPU copy of the model's parameters on rank 0 ({} elsewhere); with LoRA the merged
        weights under the plain model's names. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=opts)
        if lora.is_lora(self.model) and state:
            # what the engines serve: checkpoint names, the adapters merged into their weights
            return lora.merged_state_dict(state, lora.spec(self.model))
        return state

    def save_checkpoint(self, path: str) -> None:
        """Write model + optimizer shards to ``path`` with torch.distributed.checkpoint. Collective."""
        checkpoint.save_shards(path, self.model, self.optimizer, self.optim_steps,
                               adapters_only=lora.is_lora(self.model))

    def load_checkpoint(self, path: str) -> int:
        """Load model + optimizer from ``path``; returns the optimizer step count. Collective."""
        self.optim_steps = checkpoint.load_shards(path, self.model, self.optimizer,
                                                  adapters_only=lora.is_lora(self.model))
        return self.optim_steps

    # -- weight sync (the entry points asyncrl.sync drives) ----------------------------------

    def init_weight_sync(self, init):
        """Build this rank's sender for ``init.method`` (a `asyncrl.sync.base.SenderInit`) and connect;
        rank 0 returns one `ReceiverInit` per engine."""
        from asyncrl.sync.backends import make_sender

        if self._sender is not None:
            self._sender.close()
        self._sender = make_sender(self.model, rank=self.rank, init=init)
        return self._sender.connect()

    def weight_update_kwargs(self, *, version: int) -> dict:
        """Rank 0: per-sync keywords of the engines' ``receive_weights`` ({} for the broadcast backend)."""
        return self._sender.update_kwargs(version=version)

    def send_weights(self, **kwargs):
        # Every trainer rank calls it: gathering full tensors from FSDP shards is collective.
        return self._sender.send(**kwargs)

    def shutdown(self) -> None:
        """Leave the process group."""
        if dist.is_initialized():
            dist.destroy_process_group()
