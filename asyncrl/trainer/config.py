"""Configuration of the Trainer: the algorithm, the optimizer and the driver loop.

Each component owns one small keyword-only dataclass; cross-field checks live in
``__post_init__`` and raise ``ValueError`` naming the field and the fix. Knobs follow verl's
names where verl has one (``clip_ratio_low``, ``loss_agg_mode``, ``require_batches``,
``trigger_parameter_sync_step``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass(kw_only=True)
class AlgorithmConfig:
    """GRPO advantages and the PPO-style policy loss with off-policy correction."""

    norm_adv_by_std: bool = True
    """GRPO: divide group-centred rewards by the group's std (False: Dr. GRPO, centre only)."""
    clip_ratio_low: float = 0.2
    """PPO clip: the ratio is kept above ``1 - clip_ratio_low``."""
    clip_ratio_high: float = 0.2
    """PPO clip: the ratio is kept below ``1 + clip_ratio_high`` (raise it for clip-higher)."""
    tis_cap: float | None = 2.0
    """Truncated importance sampling: cap on the off-policy weight of a stale token; None disables."""
    decoupled: bool = False
    """Decoupled PPO: recompute proximal log-probs with the current weights before the update."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to a frozen reference model; 0 loads no reference."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses become one scalar (verl's names)."""
    temperature: float = 1.0
    """Sampling temperature the engine used; logits are divided by it before log-softmax."""

    def __post_init__(self) -> None:
        if not 0 <= self.clip_ratio_low < 1:
            raise ValueError(f"clip_ratio_low must be in [0, 1), got {self.clip_ratio_low}")
        if self.clip_ratio_high < 0:
            raise ValueError(f"clip_ratio_high must be >= 0, got {self.clip_ratio_high}")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ValueError(f"tis_cap must be >= 1 (or None to disable), got {self.tis_cap}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0 (0 disables the KL penalty), got {self.kl_coef}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warmup then a constant or cosine schedule, and gradient clipping."""

    lr: float = 1e-5
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to ``lr``."""
    schedule: Literal["constant", "cosine"] = "constant"
    """LR after warmup; ``cosine`` decays to ``min_lr_ratio * lr`` at ``total_steps``."""
    total_steps: int = 0
    """Optimizer steps the cosine schedule spans (needed only for ``cosine``)."""
    min_lr_ratio: float = 0.0
    """Floor of the cosine schedule as a fraction of ``lr``."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping (the norm is still reported)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"schedule must be 'constant' or 'cosine', got {self.schedule!r}")
        if self.schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError("schedule='cosine' needs total_steps > warmup_steps; set optim.total_steps")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA: train low-rank adapters on frozen base weights (``peft``); the weight sync carries only them."""

    rank: int = 0
    """Adapter rank r; 0 turns LoRA off (full fine-tuning)."""
    alpha: float = 16.0
    """LoRA alpha: the adapters' update is scaled by ``alpha / rank``."""
    target_modules: list[str] | None = None
    """Leaf names of the linear layers to adapt (e.g. ``[q_proj, v_proj]``); None: every linear layer
    of the decoder blocks."""
    train_norms: bool = False
    """Also train the normalization layers' weights in full (a few KB; they travel in full beside the
    adapters): lets a small model sharpen its output, which adapters on the blocks' linears alone barely do."""
    dropout: float = 0.0
    """Dropout on the adapters' input in the training forward; > 0 makes the trainer's log-probs differ
    from the engines' (``is_ratio`` leaves 1), so leave it 0 for exact on-policy runs."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0 (0 turns LoRA off), got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.target_modules is not None and not self.target_modules:
            raise ValueError("target_modules is empty; give module names or leave it unset (all linear layers)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(kw_only=True)
class WorkerConfig:
    """What one trainer rank loads and how it computes."""

    model_path: str
    """Local directory of a Hugging Face causal LM (e.g. ``asyncrl.models.default_model_path()``)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank; gradients accumulate over micro-batches."""
    pad_token_id: int = 0
    """Token id used to pad batches (masked out everywhere)."""
    stop_token_id: int | None = None
    """Response tokens after the first one of these leave the loss (`asyncrl.trainer.batch.assemble`):
    the launcher sets the EOS id when the engines do not stop at EOS (``data.long_tail``); None: all count."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA when available (bf16 mixed precision, nccl), else CPU (fp32, gloo)."""
    seed: int = 0
    """Seed of torch on every rank."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (``lora.rank`` > 0) instead of full fine-tuning."""

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is empty; give a local HF model directory")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")


@dataclass(kw_only=True)
class TrainerConfig:
    """The driver loop: how many groups make a step, staleness policy, sync and checkpoints."""

    worker: WorkerConfig
    """Per-rank settings (model, micro-batching, algorithm, optimizer)."""
    world_size: int = 1
    """Number of trainer ranks (Ray actors in one torch.distributed world)."""
    cpus_per_rank: float = 1.0
    """Ray CPUs reserved per rank actor."""
    gpus_per_rank: float = 0.0
    """Ray GPUs reserved per rank actor (1 on a GPU cluster)."""
    groups_per_batch: int = 4
    """Groups per mini-batch; one mini-batch is one optimizer step."""
    require_batches: int = 1
    """Mini-batches (optimizer steps) per train step (verl's ``require_batches``)."""
    trigger_parameter_sync_step: int = 1
    """Train steps between weight syncs (verl's name); 1 with no staleness is on-policy."""
    on_incomplete_group: Literal["raise", "drop"] = "raise"
    """``raise``: fail closed naming the sample_ids; ``drop``: drop, count and ack with the reason."""
    max_version_gap: int | None = None
    """Drop groups whose oldest token is more than this many versions behind; None keeps all."""
    recv_timeout_s: float = 600.0
    """Deadline for the next group to arrive from the source."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; None disables them (groups are then acked right after their step)."""
    checkpoint_every: int = 1
    """Train steps between checkpoints; acks wait for the checkpoint that makes a step durable,
    so the stream's window must exceed ``groups_per_batch * require_batches * checkpoint_every``."""
    samples_path: str | None = None
    """Where the audit trail goes (``<run_dir>/samples.jsonl``: one line per trained or dropped
    group, written once its step is durable); None writes none."""
    transcripts_path: str | None = None
    """Where an agent run's conversations go (``<run_dir>/transcripts.jsonl``: the first
    trajectory of every trained group, token ids and loss mask, at its step; read them with
    ``python -m asyncrl.transcripts RUN_DIR``); None: nothing is written (the launcher sets it for
    agent runs only)."""
    rank_start_timeout_s: float = 300.0
    """Deadline for every rank to load the model and join the process group."""
    step_timeout_s: float = 1800.0
    """Deadline for the ranks to finish one mini-batch, checkpoint save or load."""

    def __post_init__(self) -> None:
        for name in ("world_size", "groups_per_batch", "require_batches", "trigger_parameter_sync_step",
                     "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.on_incomplete_group not in ("raise", "drop"):
            raise ValueError(f"on_incomplete_group must be 'raise' or 'drop', got {self.on_incomplete_group!r}")
        if self.max_version_gap is not None and self.max_version_gap < 0:
            raise ValueError(f"max_version_gap must be >= 0 or None, got {self.max_version_gap}")
        if self.recv_timeout_s <= 0:
            raise ValueError(f"recv_timeout_s must be > 0, got {self.recv_timeout_s}")

    @property
    def groups_per_sync(self) -> int:
        """Groups consumed between two weight syncs: the Rollouter's staleness budget unit."""
        return self.groups_per_batch * self.require_batches * self.trigger_parameter_sync_step
