"""Run modes: ``async`` (fully asynchronous) and ``sync`` (on-policy, in lockstep).

Both modes run the same processes: engine actors, the Rollouter actor with its dataset and
reward, the ZeroMQ stream, the trainer ranks and the weight-sync coordinator. They differ
only in how far the Rollouter may run ahead of the Trainer, which the staleness gate sets:

- ``async``: the gate admits up to ``(version + 1 + staleness_threshold) * groups_per_sync``
  prompts, so generation of the next groups overlaps training and weight syncs; with partial
  rollout on, what runs at each weight sync is truncated there, in the engines, and goes on
  after it from its prefix re-read under the new weights (``partial_rollout.truncate_at=sync``).
- ``sync`` (``mode=sync``, ``--mode sync``): ``staleness_threshold = 0``, one train step per
  sync. The gate then admits exactly one step's prompts per weight version, so each step is

      generate a batch (version v) -> train on it -> sync (version v + 1) -> generate ...

  with nothing generated while the Trainer trains and nothing trained while the engines
  generate. Groups that fail or that the Trainer drops give their budget back, so their
  replacements are generated within the same step. This is the on-policy baseline (and
  ``scripts/bench_e2e.py``'s reference); it replaces the former in-process sync loop, so a
  synchronous run uses any model, dataset and reward the launcher takes.

  With partial rollout (``--mode sync --partial-rollout true``, the RFC's workflow,
  ``partial_rollout.truncate_at=threshold``) a step no longer waits for its longest response:
  each round keeps ``rollout.max_concurrent`` prompts in flight (by default twice the step's)
  and ends once the aggregator counts the step's complete groups; the unfinished responses
  are truncated and continue first in the next step, at the new weights. The engines still
  idle while the Trainer trains, but a response may now carry tokens of up to
  ``partial_rollout.max_age + 1`` versions (plain sync: one), each token trained with its own
  behaviour log-prob as the importance anchor.
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
        if partial.enable and partial.truncate_at != "sync":
            raise ValueError(f"partial_rollout.truncate_at={partial.truncate_at!r} is the synchronous workflow "
                             "(rounds end at the step's groups, engines idle while the Trainer trains): use mode "
                             "'sync', or truncate_at 'sync' in async mode")
        return
    if partial.enable and partial.truncate_at != "threshold":
        raise ValueError(f"mode 'sync' truncates a round once the step has its groups: partial_rollout.truncate_at "
                         f"must be 'threshold', got {partial.truncate_at!r} (nothing runs at a sync in this mode)")
    if trigger_parameter_sync_step != 1:
        raise ValueError(f"mode 'sync' syncs after every step: trainer.trigger_parameter_sync_step must be 1, "
                         f"got {trigger_parameter_sync_step}")
    if staleness_threshold != 0:
        raise ValueError(f"mode 'sync' is on-policy: rollout.staleness_threshold must be 0, got {staleness_threshold}")
