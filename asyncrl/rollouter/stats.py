"""`RolloutStats`: the Rollouter's counters and timers, read by the step metrics (`Rollouter.stats_now`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RolloutStats:
    """Counters and timers of the Rollouter (for the step metrics)."""

    gate_blocked_s: float = 0.0
    """Time the feed loop waited at the staleness gate (or for a concurrency slot)."""
    credit_blocked_s: float = 0.0
    """Time finished groups waited for stream credit (summed over groups)."""
    truncated: int = 0
    """Responses stopped by a round's truncation (a response stopped twice counts twice)."""
    resumed: int = 0
    """Truncated responses dispatched again."""
