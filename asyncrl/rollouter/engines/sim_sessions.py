"""What the simulated engine keeps of a conversation between its turns (`SimEngine`'s sessions).

The built-in engine keeps a finished turn's KV blocks under its ``session_id`` so the next turn
prefills only its new tokens (`asyncrl.rollouter.engines.builtin.sessions`). The simulator has no
KV; it keeps the token ids a session's KV would hold (the turn's prompt + response) and the weight
version they were computed with. A turn whose prompt extends them, on the same version, prefills
only the tokens past them; anything else (another version, a prompt that diverges, no kept turn)
prefills its whole prompt. The counters are the built-in engine's names.

Left out: the built-in engine's idle timeout and block budget (a session is kept until
`end` or a cache clear), and sharing between sessions.
"""

from __future__ import annotations

import numpy as np

COUNTERS = ("session_kept", "session_hits", "session_tokens_reused", "session_misses")


class SimSessions:
    """session_id -> (version, the token ids its KV would hold)."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[int, np.ndarray]] = {}
        self.counters = dict.fromkeys(COUNTERS, 0)

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, session_id: str, version: int, prompt_ids: np.ndarray, response_ids: np.ndarray) -> None:
        """A turn of ``session_id`` ended: its prompt + response are what the next turn may reuse."""
        self._kept[session_id] = (version, np.concatenate([prompt_ids, response_ids]))
        self.counters["session_kept"] += 1

    def new_tokens(self, session_id: str | None, version: int, prompt_ids: np.ndarray) -> int:
        """Prompt tokens a turn must prefill: those past its session's kept tokens when it extends
        them on the same version, else all. The kept entry goes to the turn (it keeps its own at its end)."""
        kept = self._kept.pop(session_id, None) if session_id is not None else None
        if kept is None:
            return len(prompt_ids)
        kept_version, ids = kept
        if kept_version != version or len(ids) > len(prompt_ids) or not np.array_equal(prompt_ids[:len(ids)], ids):
            self.counters["session_misses"] += 1
            return len(prompt_ids)
        self.counters["session_hits"] += 1
        self.counters["session_tokens_reused"] += len(ids)
        return len(prompt_ids) - len(ids)

    def end(self, session_id: str) -> None:
        self._kept.pop(session_id, None)

    def clear(self) -> None:
        """The KV cache was dropped: nothing is kept."""
        self._kept.clear()
