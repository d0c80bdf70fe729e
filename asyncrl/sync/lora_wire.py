"""What a LoRA weight sync carries, by name: the sync's side of the contract with a peft model.

A peft parameter ``base_model.model.<module>.lora_A.default.weight`` travels to the engines as
``<module>.lora_A`` (`adapter_name`), where ``<module>.weight`` is the checkpoint name of the base
weight it adapts; any other trainable parameter (``trainer.lora.train_norms``) travels under its
checkpoint name. `spec` is what an engine needs to apply them (`asyncrl.sync.lora`). The trainer
builds the peft model (`asyncrl.trainer.lora`); the sender reads it through these names only.
"""

from __future__ import annotations

import re

import torch

_PEFT_PREFIX = "base_model.model."
_ADAPTER = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.(?P<which>lora_[AB])\.default\.weight$")


def is_lora(model: torch.nn.Module) -> bool:
    """True for a model `wrap` built (a peft model, sharded or not)."""
    return hasattr(model, "peft_config")


def adapter_name(peft_name: str) -> str | None:
    """``<module>.lora_A`` / ``<module>.lora_B`` for a peft adapter parameter's name, else None."""
    m = _ADAPTER.match(peft_name)
    return f"{m['module']}.{m['which']}" if m else None


def adapter_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """What a LoRA sync carries, by wire name, in model order: the adapters (`adapter_name`) and
    any other trainable parameter (``train_norms``) under its checkpoint name."""
    out = {}
    for name, p in model.named_parameters():
        wire = adapter_name(name)
        if wire is not None:
            out[wire] = p
        elif p.requires_grad:
            out[name.removeprefix(_PEFT_PREFIX)] = p
    return out


def spec(model: torch.nn.Module) -> dict:
    """What an engine needs to merge the adapters: rank, scale (alpha / rank), the adapted modules,
    and the weights trained in full (``full``: checkpoint names, loaded as they come)."""
    cfg = model.peft_config["default"]
    names = list(adapter_params(model))
    modules = sorted({n.rsplit(".", 1)[0] for n in names if n.endswith((".lora_A", ".lora_B"))})
    full = [n for n in names if not n.endswith((".lora_A", ".lora_B"))]
    return {"rank": int(cfg.r), "scale": float(cfg.lora_alpha) / float(cfg.r), "modules": modules, "full": full}
