"""`SegmentEncoder`: a conversation encoded piece by piece gives the tokenizer's own ids, or is encoded whole."""

from __future__ import annotations

import random

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from asyncrl.agent.segments import CHECKED, SegmentEncoder
from asyncrl.models.tiny_chat import CHARS, TAGS, build_chat_tokenizer

MARKERS = ["<|im_start|>", "<|im_end|>", *TAGS]


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = list(CHARS) + ["\t", "\u00e9"] + MARKERS + ["<|im_", "<tool"]  # unknown chars, broken markers
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(n)]


def test_pieces_give_the_whole_texts_ids_and_recurring_pieces_are_encoded_once():
    backend = build_chat_tokenizer()._tokenizer
    enc = SegmentEncoder(backend)
    assert enc.exact
    for text in _texts(2000):
        assert enc(text) == backend.encode(text, add_special_tokens=False).ids, text
    assert enc.exact  # every check held
    encoded = []
    enc.whole = lambda text: encoded.append(text) or backend.encode(text, add_special_tokens=False).ids
    tools = '\n# Tools\n<tools>\n{"name": "lookup"}\n</tools>'
    for i in range(3):
        enc(f"<|im_start|>system{tools}<|im_end|>\n<|im_start|>user\nquestion {i}<|im_end|>\n")
    # (the checks are over:) the system turn's piece encoded once, each question's piece once, nothing whole
    assert encoded == [f"system{tools}", "user\nquestion 0", "user\nquestion 1", "user\nquestion 2"]


def _prefix_space_tokenizer() -> Tokenizer:
    """A tokenizer that marks only the first piece of a text with a prefix space (SentencePiece's
    'first' scheme): a piece after an added token encodes differently alone."""
    vocab = {c: i for i, c in enumerate(["<unk>", "<|im_end|>", "\u2581", *CHARS])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    core.add_special_tokens([AddedToken("<|im_end|>", special=True, normalized=False)])
    return core


def test_a_tokenizer_whose_pieces_depend_on_their_position_is_encoded_whole():
    backend = _prefix_space_tokenizer()
    enc = SegmentEncoder(backend)
    assert enc.exact  # nothing in its added tokens tells; the first check does
    text = "ab<|im_end|>cd"
    assert enc(text) == backend.encode(text, add_special_tokens=False).ids
    assert not enc.exact
    for text in _texts(200, seed=1):
        assert enc(text) == backend.encode(text, add_special_tokens=False).ids


def test_added_tokens_that_strip_whitespace_are_never_split_on():
    vocab = {c: i for i, c in enumerate(["<unk>", *CHARS])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.add_special_tokens([AddedToken("<mark>", special=True, normalized=False, lstrip=True)])
    enc = SegmentEncoder(core)
    assert not enc.exact
    assert enc("a  <mark> b") == core.encode("a  <mark> b", add_special_tokens=False).ids


def test_checks_stop_after_the_first_texts():
    backend = build_chat_tokenizer()._tokenizer
    enc = SegmentEncoder(backend)
    wholes = []
    enc.whole = lambda text: wholes.append(text) or backend.encode(text, add_special_tokens=False).ids
    for _ in range(CHECKED + 10):
        enc("<|im_start|>user\nsame<|im_end|>")
    assert wholes.count("<|im_start|>user\nsame<|im_end|>") == CHECKED


def test_the_renderer_decodes_a_turn_as_the_tokenizer_does():
    from asyncrl.agent.render import ChatRenderer

    tok = build_chat_tokenizer()
    r = ChatRenderer(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    rng = random.Random(2)
    for text in _texts(300, seed=3):
        ids = tok.encode(text, add_special_tokens=False)
        ids = ids + [im_end] if rng.random() < 0.5 else ids
        assert r.turn_text(ids) == tok.decode(ids[:-1] if ids and ids[-1] == im_end else ids)
    cleaning = build_chat_tokenizer()
    cleaning.clean_up_tokenization_spaces = True  # a clean-up after the backend: the tokenizer's own decode
    assert ChatRenderer(cleaning)._decode == cleaning.decode
