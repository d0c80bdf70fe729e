"""LoRA on the trainer: which modules get adapters, the ``peft`` wrapping, and the merged weights.

`wrap` turns a Hugging Face causal LM into a ``peft`` LoRA model before FSDP2 shards it: the base
weights are frozen (``requires_grad=False``), only the adapters (``lora_A``/``lora_B``) train, so
the optimizer holds state for them alone. `target_names` resolves ``trainer.lora.target_modules``
against the model's decoder blocks (default: every ``nn.Linear`` in them), and `check_targets`
does it on a model built on the meta device from the config alone, so the launcher refuses a bad
name before Ray starts.

Names: a peft parameter ``base_model.model.<module>.lora_A.default.weight`` travels to the engines
as ``<module>.lora_A`` (`adapter_name`), where ``<module>.weight`` is the checkpoint name of the
base weight it adapts; the engines merge ``W = W_base + scale * B @ A`` (`asyncrl.sync.lora`).
"""

from __future__ import annotations

import torch

from asyncrl.sync.lora_wire import _PEFT_PREFIX, adapter_name, adapter_params, is_lora, spec  # noqa: F401 - re-exported
from asyncrl.trainer.config import LoraConfig
from asyncrl.trainer.fsdp import decoder_blocks



def block_linear_names(model: torch.nn.Module) -> list[str]:
    """Leaf names (``q_proj``, ``down_proj``, ...) of the ``nn.Linear`` modules inside the decoder blocks."""
    names: list[str] = []
    for block in decoder_blocks(model):
        for name, module in block.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if isinstance(module, torch.nn.Linear) and leaf not in names:
                names.append(leaf)
    return names


def target_names(model: torch.nn.Module, cfg: LoraConfig) -> list[str]:
    """``cfg.target_modules`` checked against the blocks' linear layers (None: all of them).

    Raises ValueError naming the unknown module and the ones that exist.
    """
    linear = block_linear_names(model)
    if cfg.target_modules is None:
        return linear
    unknown = [m for m in cfg.target_modules if m not in linear]
    if unknown:
        raise ValueError(f"trainer.lora.target_modules: {unknown[0]!r} is not a linear layer of this model's "
                         f"decoder blocks; choose among {linear}")
    return list(cfg.target_modules)


def check_targets(model_path: str, cfg: LoraConfig) -> list[str]:
    """`target_names` on the model at ``model_path`` built on the meta device (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return target_names(model, cfg)


def wrap(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """The ``peft`` LoRA model around ``model``: adapters on the target modules, the rest frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                              target_modules=target_names(model, cfg), bias="none")
    model = get_peft_model(model, peft_cfg)
    if cfg.train_norms:
        for module in model.modules():
            if "Norm" in type(module).__name__ and getattr(module, "weight", None) is not None:
                module.weight.requires_grad_(True)
    return model


def set_dropout(model: torch.nn.Module, active: bool) -> None:
    """Switch the adapters' dropout on (the training forward) or off (log-probs); the rest stays in eval."""
    for name, module in model.named_modules():
        if name.endswith("lora_dropout.default"):
            module.train(active)


@torch.no_grad()
def merged_state_dict(state: dict[str, torch.Tensor], lora_spec: dict) -> dict[str, torch.Tensor]:
    """A LoRA model's full state dict (peft names) as the plain model's: checkpoint names, with
    every adapted weight merged (``W_base + scale * B @ A``); the adapters themselves dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if adapter_name(name) is not None:
            continue
        plain = name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
        out[plain] = t
    for module in lora_spec["modules"]:
        a = state[f"{_PEFT_PREFIX}{module}.lora_A.default.weight"]
        b = state[f"{_PEFT_PREFIX}{module}.lora_B.default.weight"]
        base = out[f"{module}.weight"]
        out[f"{module}.weight"] = base + lora_spec["scale"] * (b.to(base.dtype) @ a.to(base.dtype))
    return out
