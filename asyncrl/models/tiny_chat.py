"""A tiny tool-capable chat tokenizer (and a tiny model over it), built from code (nothing
downloaded): for tests and demos. ``python -m asyncrl.models.tiny_chat OUT_DIR`` saves the model
(``python -m asyncrl.agent.tiny_chat`` still does, as the README says).

Character-level over printable ASCII and newline, plus ChatML's markers and the Hermes/Qwen tool
tags as single tokens, with a Qwen-style ChatML chat template that has a tools section and the
``tool`` role (consecutive tool results share one ``user`` turn, each in ``<tool_response>``).
The tags are added tokens, so ``<tool_call>`` is one token in a prompt and one token sampled.
"""

from __future__ import annotations

PAD, EOS = "<pad>", "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))

# Qwen 2.5's template, shortened: one system turn (the system message and/or the tools), then
# ChatML turns; tool results grouped into one user turn.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The same ChatML turns with the tools named in one short system line (no JSON schemas): a
# character-level tiny model's prompts stay a few dozen tokens (`asyncrl.demos.calculator`).
CHATML_TOOL_NAMES_TEMPLATE = CHATML_TOOLS_TEMPLATE.replace(
    "{{- '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}",
    "{{- 'tools:' }}{%- for tool in tools %}{{- ' ' + tool.function.name }}{%- endfor %}{{- '<|im_end|>\\n' }}")


def build_chat_tokenizer(template: str = CHATML_TOOLS_TEMPLATE):
    """A character-level ``PreTrainedTokenizerFast`` with ``template`` (`CHATML_TOOLS_TEMPLATE`) as its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, EOS, IM_START, IM_END]
    vocab = {tok: i for i, tok in enumerate([*specials, *TAGS, *CHARS])}
    # A BPE without merges: each character its own token, the text between added tokens one
    # piece (a pre-tokenizer that splits every character gives the same ids at ~3x the cost,
    # and the agent loop encodes on the Rollouter's event loop).
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=PAD))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=PAD)
    tok.chat_template = template
    return tok


def build_chat_model(path, seed: int = 0):
    """A tiny Qwen2 with random weights over `build_chat_tokenizer`, saved to ``path`` (model and
    tokenizer, standard Hugging Face files): a model a `ToolEnv` run accepts, for demos and tests."""
    from transformers import Qwen2Config

    from asyncrl.models.tiny import TINY_CONFIG, save_random_model

    tok = build_chat_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      **{**TINY_CONFIG, "max_position_embeddings": 1024})
    return save_random_model(cfg, tok, path, seed)


def main(argv: list[str] | None = None) -> None:
    """``python -m asyncrl.models.tiny_chat OUT_DIR``: save the tiny chat model there, print its path."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m asyncrl.models.tiny_chat OUT_DIR  (saves a tiny random chat model with tool support)")
    print(build_chat_model(args[0]))


if __name__ == "__main__":
    main()
