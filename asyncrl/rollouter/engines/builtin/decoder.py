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

`LlamaDecoder.supports` says which models it takes; every other model runs through its own
``forward`` with the cache as ``past_key_values`` (``TorchEngineConfig.decoder="hf"``
forces that path for any model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncrl.rollouter.engines.builtin.kv_cache import PagedKVCache

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
        h = self.core.embed_tokens(ids)
        cos, sin = self.core.rotary_emb(h, positions)
        cos, sin = cos[:, None], sin[:, None]
        for i, layer in enumerate(self.core.layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = layer.input_layernorm(h)
            qs = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(rows, q, self.heads, self.head_dim)
            ks = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(rows, q, self.kv_heads, self.head_dim)
            vs = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(rows, q, self.kv_heads, self.head_dim)
            if self.qk_norm:
                qs, ks = attn.q_norm(qs), attn.k_norm(ks)
            qs, ks, vs = qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
            qs = qs * cos + _rotate_half(qs) * sin
            ks = ks * cos + _rotate_half(ks) * sin
            keys, values = cache.update(ks, vs, i)
            out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=self.scale,
                                                 enable_gqa=self.heads != self.kv_heads)
            out = out.transpose(1, 2).reshape(rows, q, self.heads * self.head_dim)
            h = h + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            x = layer.post_attention_layernorm(h)
            gate = F.linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)
            up = F.linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
            h = h + F.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        h = h[torch.arange(rows, device=h.device), last] if q > 1 else h[:, 0]
        return self.model.lm_head(self.core.norm(h))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
