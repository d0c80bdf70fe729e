"""LoRA adapters kept unmerged in the lean forward: ``y = x W^T + b + s (x A^T) B^T``.

A LoRA weight sync then only copies the adapters into these tensors (a few MB) instead of
rewriting every adapted weight (``W = W_base + s B @ A`` over the whole model, which costs about
as much as a full sync's transfer), the engine keeps no second copy of the base, and the
forward is the trainer's (peft's ``base(x) + lora_B(lora_A(x)) * scaling``, in that order), so
the engine samples from the trainer's weights to float rounding.

The lean forward fuses q/k/v into one product and gate/up into another; their adapters are
fused the same way: the members' ``A`` stacked by rows (``[k r, in]``) and one ``B``
(``[out, k r]``) holding each member's ``B`` in its own row and column block, zeros elsewhere,
so one extra pair of products serves the fused projection. Each adapter's ``A``/``B`` is a view
of those tensors, by the trainer's name (``<module>.lora_A`` / ``.lora_B``). Until an adapter
is loaded its ``B`` is zero and the layer computes exactly its base.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: The lean forward's fused projections: slot -> (members, the module they belong to).
SLOTS = {"qkv": (("q_proj", "k_proj", "v_proj"), "self_attn"), "o": (("o_proj",), "self_attn"),
         "gate_up": (("gate_proj", "up_proj"), "mlp"), "down": (("down_proj",), "mlp")}


class LoraSlots:
    """Every layer's adapters for the lean forward, by fused slot (see the module docstring)."""

    def __init__(self, layers, rank: int, scale: float, modules: list[str], prefix: str = "model.layers") -> None:
        self.scale = float(scale)
        self.spec = (rank, self.scale, tuple(modules))
        self.layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in layers]
        """Per layer: slot -> (A ``[k r, in]``, B ``[out, k r]``)."""
        self.views: dict[str, torch.Tensor] = {}
        """``<module>.lora_A`` / ``.lora_B`` -> a view into a slot's tensors."""
        wanted = set(modules)
        for i, layer in enumerate(layers):
            for slot, (members, part) in SLOTS.items():
                self._build(i, slot, [(f"{prefix}.{i}.{part}.{m}", getattr(getattr(layer, part), m)) for m in members],
                            wanted, rank)
        unknown = sorted(wanted - {n.rsplit(".", 1)[0] for n in self.views})
        if unknown:
            raise ValueError(f"LoRA: the engine's model has no adapted linear layer {unknown[0]}")

    def _build(self, i: int, slot: str, members: list[tuple[str, torch.nn.Linear]], wanted: set[str],
               rank: int) -> None:
        adapted = [(name, lin) for name, lin in members if name in wanted]
        if not adapted:
            return
        weight = members[0][1].weight
        out = sum(lin.weight.shape[0] for _, lin in members)
        a = weight.new_zeros(len(adapted) * rank, weight.shape[1])
        b = weight.new_zeros(out, len(adapted) * rank)
        row, col = 0, 0
        for name, lin in members:
            rows = lin.weight.shape[0]
            if name in wanted:
                self.views[f"{name}.lora_A"] = a[col : col + rank]
                self.views[f"{name}.lora_B"] = b[row : row + rows, col : col + rank]
                col += rank
            row += rows
        self.layers[i][slot] = (a, b)

    def apply(self, i: int, slot: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base product of slot ``slot`` in layer ``i``) plus its adapters' update, if any."""
        ab = self.layers[i].get(slot)
        if ab is None:
            return y
        return y + F.linear(F.linear(x, ab[0]), ab[1]) * self.scale
