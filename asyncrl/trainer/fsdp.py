"""FSDP2 sharding of a Hugging Face causal LM: one plain function, no wrapper classes.

Leaves out activation checkpointing and torch.compile (the CPU tests gain nothing from
them); they would go here, before ``fully_shard``, in that order.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of an HF causal LM (``model.model.layers`` and kin)."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    raise ValueError(f"{type(model).__name__}: no decoder block list found (looked for model.layers, "
                     "transformer.h, gpt_neox.layers, model.decoder.layers)")


def parallelize(model: torch.nn.Module, mesh: DeviceMesh, *, mixed_precision: bool = False,
                reshard_after_forward: bool = True) -> torch.nn.Module:
    """Shard ``model`` in place with FSDP2 over ``mesh`` and return it.

    Each decoder block becomes its own FSDP unit so only one block's full parameters exist at
    a time during forward/backward; the root unit then holds what is left (embeddings, final
    norm, LM head; tied embeddings stay one parameter because they live in the same unit).
    With ``mixed_precision`` (GPU) parameters compute in bf16 while gradients reduce in fp32,
    so the optimizer's fp32 master weights see full-precision averages.
    """
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision else MixedPrecisionPolicy())
    # a peft (LoRA) model keeps the HF model inside it: the blocks are that model's
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    for block in decoder_blocks(inner):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    # The root last: it picks up every parameter not already in a block's unit.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model
