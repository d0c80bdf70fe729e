"""Encoding a conversation's text piece by piece: the text between added tokens once per distinct piece.

A fast tokenizer splits its input at its added tokens (ChatML's ``<|im_start|>``, ``<|im_end|>``,
the tool tags) before anything else sees it, and encodes the pieces between them on their own.
So the pieces that recur in every conversation (the tools' schemas in the system turn, a role
line, the markers around a tool's reply) need encoding only once; after that a prompt costs
the encoding of its new pieces only. With a real tool set the schemas are most of a prompt's
text, and the agent loop encodes on the Rollouter's event loop.

`SegmentEncoder` does that where it is exact: every added token matched as written (no
stripping of the whitespace around it, no whole-word rule, not normalized), and its own ids equal
to the whole text's encoding on the first `CHECKED` texts it is given. A tokenizer that treats
a piece differently by its position (a prefix space for the first piece only) fails that check
and is encoded whole from then on.
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger("asyncrl.agent")

CHECKED = 64
"""Texts whose pieces' ids are compared with the whole text's encoding before pieces alone are trusted."""
KEPT_CHARS = 4_000_000
"""Characters of encoded pieces kept (the cache starts over beyond it)."""


class SegmentEncoder:
    """``text -> ids`` as ``backend.encode(text, add_special_tokens=False).ids`` gives them (see the module docstring)."""

    def __init__(self, backend: Any):
        self.backend = backend
        added = backend.get_added_tokens_decoder()
        self.exact = bool(added) and all(not (t.lstrip or t.rstrip or t.single_word or t.normalized)
                                         for t in added.values())
        """Whether pieces may be encoded alone (while the checks hold)."""
        self._added = {t.content: i for i, t in added.items()}
        contents = sorted(self._added, key=len, reverse=True)  # the longest first, as the tokenizer matches
        self._split = re.compile("(" + "|".join(map(re.escape, contents)) + ")").split if contents else None
        self._pieces: dict[str, tuple[int, ...]] = {}
        """Each piece's ids, as tuples: the collector stops tracking a tuple of ints after its first
        look, where lists of hundreds of ids would be walked again by every collection."""
        self._kept_chars = 0
        self._checks_left = CHECKED

    def whole(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def __call__(self, text: str) -> list[int]:
        if not self.exact:
            return self.whole(text)
        ids: list[int] = []
        for j, part in enumerate(self._split(text)):
            if j % 2:
                ids.append(self._added[part])
            elif part:
                piece = self._pieces.get(part)
                if piece is None:
                    piece = tuple(self.whole(part))
                    if self._kept_chars + len(part) > KEPT_CHARS:
                        self._pieces.clear()
                        self._kept_chars = 0
                    self._pieces[part] = piece
                    self._kept_chars += len(part)
                ids += piece
        if self._checks_left:
            self._checks_left -= 1
            whole = self.whole(text)
            if ids != whole:
                self.exact = False
                log.info("the tokenizer encodes a piece between its added tokens differently alone; "
                         "conversations are encoded whole")
                return whole
        return ids
