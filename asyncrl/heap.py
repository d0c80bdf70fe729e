"""A process's heap: keep Python's garbage collector from pausing its event loop (the Rollouter's, the endpoint's)."""

from __future__ import annotations

GC_YOUNG_THRESHOLD = 20_000
"""Allocations between collections of Python's youngest generation in the Rollouter's process (`settle_gc`)."""


def settle_gc() -> None:
    """Keep the garbage collector from pausing a busy Rollouter's event loop.

    Each request allocates futures, tasks and arrays that live for its lifetime. Under Python's
    default thresholds (700 allocations) they outlive several young collections, reach the
    oldest generation, and make full collections of the whole heap (modules, tokenizer, dataset
    included) run about once a second: at 128 simulated replicas 1.5 s of 7 s went to them, up to
    190 ms at once (``scripts/bench_scale.py``). Call once the process is set up: what exists now
    is frozen out of every later collection (`gc.freeze`), and the youngest generation is
    collected every ``GC_YOUNG_THRESHOLD`` allocations, so most per-request objects die before
    a collection sees them. Reference cycles are still collected.
    """
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 100)
