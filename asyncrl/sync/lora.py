"""Adapter-only weight sync: the engine side applies LoRA adapters exactly, without drift.

With ``trainer.lora.rank`` > 0 the trainer's sender puts only the adapters on the wire (same
header, metadata and buckets as a full sync; tensors named ``<module>.lora_A`` / ``.lora_B``,
see `asyncrl.trainer.lora`), and every `ReceiverInit` carries the adapters' spec in
``options["lora"]`` (rank, scale = alpha / rank, adapted modules). The receiver then loads into
a `LoraMerger` wrapped around its engine instead of the engine itself, which applies them one of
two ways:

- **Unmerged**, where the engine keeps adapters in its own forward (the ``lora_views`` hook: the
  built-in engine's lean forward, `asyncrl.rollouter.engines.builtin.lora`): the received A and
  B are copied into the engine's adapters (the receiver loads only while the engine is paused);
  nothing is merged and the base weights are never written.
- **Merged** otherwise: at construction the merger reads the base weight of every adapted module
  from the model directory's safetensors files (the same bytes the engine loaded at start) and
  keeps them; `load_weights` keeps the received A and B (copies: they arrive as views of reused
  buffers); `finish_weight_update` computes ``W = W_base + scale * B @ A`` for every module: into
  the built-in engine's parameters directly (its ``weight_views`` hook, engine paused: one
  ``addmm`` per module reads the kept base and writes the parameter), or, in a vLLM worker, as
  tensors handed to the same staged ``reload_weights`` as a full sync; then the engine's
  ``finish_weight_update``.

Exact, no drift: every merge starts again from the kept base, never from the weights the
previous sync merged (merging ``B @ A`` in place would add each step's rounding error to the
next and could not take an old update back out), so after N syncs the engine holds exactly
the base plus the current adapters, as the trainer does.

A fused vLLM layer (``qkv_proj`` packs q, k and v, with their biases) is reloaded as a whole:
with ``siblings`` the merger also keeps and re-sends every other checkpoint tensor under an
adapted module's parent (``...self_attn.*``, ``...mlp.*``), unchanged, so no part of a
reloaded layer is left unset. Costs of merging: the kept base (every adapted weight, plus the
siblings in vLLM: about the blocks' weights with the default all-linear targets) in each engine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch


def read_checkpoint_tensors(model_dir: str | Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors named ``names`` from a model directory's safetensors files (copies)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}: LoRA sync needs the base weights there")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                if key in names:
                    out[key] = fh.get_tensor(key).clone()
    return out


def checkpoint_names(model_dir: str | Path) -> list[str]:
    """Every tensor name in a model directory's safetensors files."""
    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            names.extend(fh.keys())
    return names


class LoraMerger:
    """The engine a receiver loads into under LoRA sync (see module doc)."""

    def __init__(self, engine, spec: dict, model_dir: str | Path, *, siblings: bool = False) -> None:
        self.engine = engine
        self.rank = int(spec["rank"])
        self.scale = float(spec["scale"])
        self.modules = list(spec["modules"])
        self.full = list(spec.get("full", ()))
        """Weights the trainer trains in full (``train_norms``): loaded as they arrive."""
        self.siblings = siblings
        self.received: dict[str, torch.Tensor] = {}
        hook = None if siblings else getattr(engine, "lora_views", None)
        self.adapters: dict[str, torch.Tensor] | None = hook(self.rank, self.scale, self.modules) if hook else None
        """The engine's own unmerged adapters (the built-in engine's lean forward): the received
        A and B are copied into them and nothing is merged; None: merge onto the kept base."""
        wanted = set(self.full) if self.adapters is not None else {f"{m}.weight" for m in self.modules} | set(self.full)
        if siblings:
            parents = tuple(m.rsplit(".", 1)[0] + "." for m in self.modules)
            wanted |= {n for n in checkpoint_names(model_dir) if n.startswith(parents)}
        self.base = read_checkpoint_tensors(model_dir, wanted)
        missing = sorted(n for n in wanted if n not in self.base and n.endswith(".weight"))
        if missing:
            raise ValueError(f"LoRA sync: the engine's model directory {model_dir} has no base weight {missing[0]} "
                             "(the trainer and the engines must load the same model)")

    def param_meta(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """The adapters this engine takes: ``<module>.lora_A`` [r, in] and ``<module>.lora_B`` [out, r]."""
        out = []
        for m in self.modules:
            if self.adapters is not None:
                rows, cols = self.adapters[f"{m}.lora_B"].shape[0], self.adapters[f"{m}.lora_A"].shape[1]
            else:
                rows, cols = self.base[f"{m}.weight"].shape
            out += [(f"{m}.lora_A", torch.float32, (self.rank, cols)),
                    (f"{m}.lora_B", torch.float32, (rows, self.rank))]
        return out + [(n, torch.float32, tuple(self.base[n].shape)) for n in self.full]

    async def load_weights(self, named_tensors) -> None:
        # views into the receiver's reused bucket buffers: copy them out (an engine's own
        # adapters take them at once: the receiver loads only while the engine is paused)
        for name, t in named_tensors:
            if self.adapters is not None and name in self.adapters:
                self.adapters[name].copy_(t)
                self.received[name] = self.adapters[name]
            else:
                self.received[name] = t.clone()

    @torch.no_grad()
    def merged(self) -> list[tuple[str, torch.Tensor]]:
        """Checkpoint-named weights to load: base + scale * B @ A per module (plus unchanged siblings)."""
        self._check_received()
        out = {name: t for name, t in self.base.items()}
        out.update((n, self.received[n]) for n in self.full)
        for m in self.modules:
            base = self.base[f"{m}.weight"]
            a, b = self.received[f"{m}.lora_A"].float(), self.received[f"{m}.lora_B"].float()
            out[f"{m}.weight"] = base.float() + self.scale * (b @ a)
        return list(out.items())

    def _check_received(self) -> None:
        missing = [m for m in self.modules if f"{m}.lora_A" not in self.received or f"{m}.lora_B" not in self.received]
        missing += [n for n in self.full if n not in self.received]
        if missing:
            raise ValueError(f"LoRA sync: nothing received for {missing[0]} ({len(missing)} missing)")

    @torch.no_grad()
    def _merge_into(self, views: dict[str, torch.Tensor]) -> None:
        """``W = W_base + scale * B @ A`` written straight into the engine's parameters (one pass,
        no temporary: ``addmm`` reads the kept base and writes the parameter)."""
        self._check_received()
        for m in self.modules:
            name = f"{m}.weight"
            base, dst = self.base[name], views[name]
            a, b = self.received[f"{m}.lora_A"].to(base.dtype), self.received[f"{m}.lora_B"].to(base.dtype)
            if dst.dtype == base.dtype and dst.is_contiguous():
                torch.addmm(base, b, a, alpha=self.scale, out=dst)
            else:
                dst.copy_(torch.addmm(base, b, a, alpha=self.scale))
        for n in self.full:
            views[n].copy_(self.received[n])

    async def finish_weight_update(self, version: int) -> None:
        """Merge onto the kept base, load through the engine's own path, make it live as ``version``.

        An engine with its own adapters (``lora_views``) has them already: nothing to merge. An
        engine with the ``weight_views`` hook (the built-in one without its lean forward) gets the merge written
        into its parameters directly; any other (a vLLM worker) gets the merged weights through its
        ``load_weights``."""
        hook = getattr(self.engine, "weight_views", None)
        if self.adapters is not None:
            self._check_received()
            views = hook() if self.full else {}
            for n in self.full:
                views[n].copy_(self.received[n])
            self.received = {}
        elif hook is not None and not self.siblings:
            views = hook()
            await asyncio.to_thread(self._merge_into, views)
            self.received = {}
        else:
            weights, self.received = self.merged(), {}
            await self.engine.load_weights(weights)
        await self.engine.finish_weight_update(version)
