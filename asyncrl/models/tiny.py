"""The tiny default model: a Qwen2-architecture decoder built from a config, no download.

It is saved as standard Hugging Face files (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``), so the code that loads it is the code that
loads a real model from a local directory. The tokenizer is character-level over a small
alphabet, enough for the built-in verifiable tasks.
"""

from __future__ import annotations

import os
from pathlib import Path

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
ALPHABET = "0123456789+-*/=()<>,.:;?! abcdefghijklmnopqrstuvwxyz"

#: Shape of the default tiny decoder (about 0.2M parameters, tied embeddings). Two query heads
#: of size 32 sharing one key/value head: vLLM's CPU attention takes head sizes 32, 64, 80, 96,
#: ... only, and this keeps the projections' shapes (and the parameter count) of the former
#: 4-query / 2-key-value heads of size 16.
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast``: one token per character of ALPHABET."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *ALPHABET])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=PAD
    )


def build_tiny_model(path: str | os.PathLike, seed: int = 0, **overrides):
    """Build the tiny model with random weights and save model + tokenizer to ``path``."""
    from transformers import Qwen2Config

    tok = build_tokenizer()
    cfg = Qwen2Config(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **{**TINY_CONFIG, **overrides},
    )
    return save_random_model(cfg, tok, path, seed)


def save_random_model(cfg, tok, path: str | os.PathLike, seed: int = 0) -> Path:
    """A causal LM of ``cfg`` with seeded random fp32 weights, saved with ``tok`` to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
