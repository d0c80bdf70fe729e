"""A lean forward for Llama-family decoders (Llama, Qwen2, Qwen3, Mistral without a window).

The engine's steps are small (one token per running request), so on CPU a Hugging Face
forward spends most of its time in Python around the math: module calls, hooks, mask and
cache plumbing (about 4.4 ms of a 5 ms step on the 4-layer model of ``bench_engine.py``'s
short workload). `LlamaDecoder` runs the same computation with the model's own parameters
(no copy: weights loaded in place are live at once) as a flat sequence of torch calls:
embedding, and per layer RMSNorm (the model's own module), the q/k/v projections, rotary
embedding (the model's own ``rotary_emb``, so every RoPE scaling type is the model's),
the paged KV write and read, `scaled_dot_product_attention` with grouped heads, the output
projection, RMSNorm and the gated MLP; then the final norm and ``lm_head`` on each row's
last real query only. It matches ``model(...)`` to float rounding (tested).

Fewer, larger calls, since a decode step is per-op overhead on CPU: each layer's q/k/v
projections are one matrix product (and gate/up another) over a fused weight whose slices
ARE the model's parameters (their ``.data`` points into it, so in-place weight loads and
``weight_views`` land in it); rotary embedding is applied to the queries and keys in one go;
cos/sin come from a table of the model's own ``rotary_emb`` over positions ``0..n`` (one lookup
a step instead of recomputing them; RoPE types whose values depend on the sequence length,
``dynamic`` and ``longrope``, are computed per step); RMSNorm is the models' formula inline.

`LlamaDecoder.supports` says which models it takes; every other model runs through its own
``forward`` with the cache as ``past_key_values`` (``TorchEngineConfig.decoder="hf"``
forces that path for any model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncrl.rollouter.engines.builtin.kv_cache import PagedKVCache
from asyncrl.rollouter.engines.builtin.lora import LoraSlots

#: ``config.model_type`` values whose decoder layers have the Llama layout.
MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


class LlamaDecoder:
    """The Llama-layout forward over a `PagedKVCache` (see the module docstring)."""

    def __init__(self, model) -> None:
        cfg = model.config
        self.model = model
        self.core = model.model
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.qk_norm = hasattr(self.core.layers[0].self_attn, "q_norm")
        self.qkv = [_fuse(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
                    for layer in self.core.layers]
        self.gate_up = [_fuse(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in self.core.layers]
        rope_type = getattr(self.core.rotary_emb, "rope_type", "default")
        self._rope_table = not any(kind in str(rope_type) for kind in ("dynamic", "longrope"))
        self._cos = self._sin = None
        self.lora: LoraSlots | None = None
        """Unmerged LoRA adapters (`attach_lora`), or None."""

    def attach_lora(self, rank: int, scale: float, modules: list[str]) -> dict[str, torch.Tensor]:
        """Adapters for ``modules`` in the forward (zeros when new; the same ones again for the same
        spec), their ``lora_A``/``lora_B`` views by name."""
        if self.lora is None or self.lora.spec != (rank, float(scale), tuple(modules)):
            self.lora = LoraSlots(self.core.layers, rank, scale, modules)
        return dict(self.lora.views)

    def _rotary(self, h: torch.Tensor, positions: torch.Tensor, need: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[rows, 1, q, head_dim]`` at ``positions`` (all below ``need``): the model's
        ``rotary_emb``, looked up in a table of it (grown by doubling) where its values do not
        depend on the length."""
        if not self._rope_table:
            cos, sin = self.core.rotary_emb(h, positions)
            return cos[:, None], sin[:, None]
        if self._cos is None or self._cos.shape[0] < need or self._cos.dtype != h.dtype:
            n = max(256, 1 << (need - 1).bit_length())
            every = torch.arange(n, device=h.device)[None]
            cos, sin = self.core.rotary_emb(h, every)
            self._cos, self._sin = cos[0], sin[0]
        at, shape = positions.reshape(-1), (*positions.shape, 1, -1)  # index_select: cheaper than [positions]
        return (self._cos.index_select(0, at).view(shape).transpose(1, 2),
                self._sin.index_select(0, at).view(shape).transpose(1, 2))

    @staticmethod
    def supports(model) -> bool:
        """True for a Llama-layout decoder with full attention on every layer."""
        cfg = model.config
        if getattr(cfg, "model_type", None) not in MODEL_TYPES or not hasattr(model, "lm_head"):
            return False
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            if set(layer_types) != {"full_attention"}:
                return False
        elif getattr(cfg, "sliding_window", None) is not None:  # Mistral with a window
            return False
        core = getattr(model, "model", None)
        layers = getattr(core, "layers", None)
        if not layers or not hasattr(core, "rotary_emb"):
            return False
        attn, mlp = layers[0].self_attn, layers[0].mlp
        return all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) and all(
            hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: PagedKVCache,
                 last: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` after each row's query ``last[r]``; ``ids``/``positions`` are
        ``[rows, q]``, ``mask`` ``[rows, 1, q, width]`` (True = attend)."""
        rows, q = ids.shape
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        lora = self.lora
        h = self.core.embed_tokens(ids)
        cos, sin = self._rotary(h, positions, cache.get_seq_length())
        for i, layer in enumerate(self.core.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = _rms_norm(layer.input_layernorm, h)
            qkv = F.linear(x, *self.qkv[i])
            if lora is not None:
                qkv = lora.apply(i, "qkv", x, qkv)
            qkv = qkv.view(rows, q, heads + 2 * kv_heads, dim)
            if self.qk_norm:
                qk = torch.cat([attn.q_norm(qkv[:, :, :heads]), attn.k_norm(qkv[:, :, heads:heads + kv_heads])], 2)
            else:
                qk = qkv[:, :, : heads + kv_heads]
            qk = qk.transpose(1, 2)
            qk = qk * cos + _rotate_half(qk) * sin  # queries and keys rotated together
            qs, ks = qk[:, :heads], qk[:, heads:]
            vs = qkv[:, :, heads + kv_heads :].transpose(1, 2)
            keys, values = cache.update(ks, vs, i)
            out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=heads != kv_heads)
            out = out.transpose(1, 2).reshape(rows, q, heads * dim)
            o = F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            h = h + (o if lora is None else lora.apply(i, "o", out, o))
            x = _rms_norm(layer.post_attention_layernorm, h)
            gate_up = F.linear(x, *self.gate_up[i])
            gate, up = (gate_up if lora is None else lora.apply(i, "gate_up", x, gate_up)).chunk(2, dim=-1)
            act = mlp.act_fn(gate) * up
            down = F.linear(act, mlp.down_proj.weight, mlp.down_proj.bias)
            h = h + (down if lora is None else lora.apply(i, "down", act, down))
        h = h[torch.arange(rows, device=h.device), last] if q > 1 else h[:, 0]
        return self.model.lm_head(_rms_norm(self.core.norm, h))


def _fuse(*linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``linears`` applied to the same input, stacked by output rows;
    each linear's parameters become views of it, so writes into them (weight loads) update it."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = [lin.bias is not None for lin in linears]
    bias = None
    if any(has_bias):  # a linear without one adds zeros
        bias = torch.cat([lin.bias.detach() if b else weight.new_zeros(lin.weight.shape[0])
                          for lin, b in zip(linears, has_bias)])
    row = 0
    for lin, b in zip(linears, has_bias):
        n = lin.weight.shape[0]
        lin.weight.data = weight[row : row + n]
        if b:
            lin.bias.data = bias[row : row + n]
        row += n
    return weight, bias


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """The Llama/Qwen RMSNorm of ``norm`` (its weight and epsilon) on ``x``, same op order; the
    float32 round trip only where ``x`` is not float32 already."""
    if x.dtype != torch.float32:
        return norm(x)
    eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
