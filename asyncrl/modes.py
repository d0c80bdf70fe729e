"""Run modes: ``async`` (fully asynchronous) and ``sync`` (on-policy, in lockstep).

Both modes run the same processes: engine actors, the Rollouter actor with its dataset and
reward, the ZeroMQ stream, the trainer ranks and the weight-sync coordinator. They differ
only in how far the Rollouter may run ahead of the Trainer, which the staleness gate sets:

- ``async``: the gate admits up to ``(version + 1 + staleness_threshold) * groups_per_sync``
  prompts, so generation of the next groups overlaps training and weight syncs; with partial
  rollout on, the aggregator truncates each round's long tail.
- ``sync`` (``mode=sync``, ``--mode sync``): ``staleness_threshold = 0``, one train step per
  sync, no partial rollout. The gate then admits exactly one step's prompts per weight
  version, so each step is

      generate a batch (version v) -> train on it -> sync (version v + 1) -> generate ...

  with nothing generated while the Trainer trains and nothing trained while the engines
  generate. Groups that fail or that the Trainer drops give their budget back, so their
  replacements are generated within the same step. This is the on-policy baseline (and
  ``scripts/bench_e2e.py``'s reference); it replaces the former in-process sync loop, so a
  synchronous run uses any model, dataset and reward the launcher takes.
"""

from __future__ import annotations

from asyncrl.rollouter.partial import PartialRolloutConfig

MODES: tuple[str, ...] = ("async", "sync")


def check_mode(mode: str, *, staleness_threshold: float, partial: PartialRolloutConfig,
               trigger_parameter_sync_step: int) -> None:
    """Raise ValueError naming a setting that ``mode`` cannot honour."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "async":
        return
    if partial.enable:
        raise ValueError("mode 'sync' generates each batch to the end before training: "
                         "set partial_rollout.enable=false")
    if trigger_parameter_sync_step != 1:
        raise ValueError(f"mode 'sync' syncs after every step: trainer.trigger_parameter_sync_step must be 1, "
                         f"got {trigger_parameter_sync_step}")
    if staleness_threshold != 0:
        raise ValueError(f"mode 'sync' is on-policy: rollout.staleness_threshold must be 0, got {staleness_threshold}")
