"""Ctrl-C and SIGTERM for the launcher: the first stops cleanly, a second (or a deadline) at once.

``ray job stop`` sends SIGTERM; a terminal's Ctrl-C sends SIGINT. Both mean the same here::

    first signal ─► on_stop(): the Trainer abandons a step still collecting groups, or finishes
                    the one training; the launcher then checkpoints (so every group trained is
                    durable and acked), drains the Rollouter, closes the stream, the ranks and
                    the engines in that order, and exits 0
    second signal, or ``deadline_s`` after the first ─► the launcher's main task is cancelled:
                    every process is killed without a checkpoint (the last one stays valid),
                    exit 130

`GracefulStop` installs its handlers on the running event loop for the duration of a
``with`` block and puts the previous ones back after it.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable

SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_INTERRUPTED = 130
"""Exit status after a stop that could not finish cleanly (128 + SIGINT, as shells report it)."""


class GracefulStop:
    """Turns SIGINT/SIGTERM into ``on_stop()`` first, and into cancelling ``task`` after that."""

    def __init__(self, on_stop: Callable[[], None], *, task: asyncio.Task | None = None, deadline_s: float = 300.0):
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.on_stop = on_stop
        self.task = task
        self.deadline_s = deadline_s
        self.requested: str | None = None
        """Name of the first signal received (None while none was)."""
        self.hard: str | None = None
        """Why the stop became immediate (a second signal, the deadline), else None."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def __enter__(self) -> GracefulStop:
        self._loop = asyncio.get_running_loop()
        self.task = self.task or asyncio.current_task()
        for sig in SIGNALS:
            self._loop.add_signal_handler(sig, self._on_signal, sig)
        return self

    def __exit__(self, *exc) -> None:
        for sig in SIGNALS:
            self._loop.remove_signal_handler(sig)
        if self._timer is not None:
            self._timer.cancel()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.requested is None:
            self.requested = sig.name
            _say(f"{sig.name}: stopping cleanly (finish or abandon the step, checkpoint, drain); "
                 f"press Ctrl-C again to stop at once")
            self._timer = self._loop.call_later(self.deadline_s, self._stop_now,
                                                f"the clean stop took over {self.deadline_s}s (deadline_s)")
            self.on_stop()
        else:
            self._stop_now(f"second signal ({sig.name})")

    def _stop_now(self, why: str) -> None:
        if self.hard is not None:
            return
        self.hard = why
        _say(f"{why}: stopping at once, without a checkpoint (the last one stays valid)")
        if self.task is not None:
            self.task.cancel()


def _say(text: str) -> None:
    print(f"asyncrl: {text}", file=sys.stderr, flush=True)
