"""The launcher's flags: short aliases of dotted config keys, listed once.

`asyncrl.launch` builds its argument groups from `FLAGS`; the loader names a key with its flag
(`named`) when one sets it. This module imports nothing, so ``--help`` stays instant.
"""

from __future__ import annotations

from typing import NamedTuple


class Flag(NamedTuple):
    """``--name`` sets the dotted ``key``; ``type`` is shown in ``--help`` (OmegaConf coerces the text)."""

    name: str
    key: str
    type: type
    help: str


FLAGS: dict[str, list[Flag]] = {
    "placement": [
        Flag("rollouter_gpus", "placement.rollouter_gpus", int,
             "GPUs for inference engines (one replica per engine.tensor_parallel_size GPUs); 0 = built-in engine on CPU"),
        Flag("trainer_gpus", "placement.trainer_gpus", int, "GPUs for FSDP2 trainer ranks; 0 = CPU ranks"),
        Flag("engines", "placement.engines", int, "built-in engine replicas when --rollouter-gpus is 0 (default 1)"),
        Flag("trainer_ranks", "placement.trainer_ranks", int, "trainer ranks when --trainer-gpus is 0 (default 1)"),
        Flag("nodes", "placement.nodes", int, "nodes to spread the Rollouter and the Trainer over (default 1)"),
        Flag("address", "placement.address", str, "Ray address to join (default: RAY_ADDRESS, else a local Ray)"),
    ],
    "model and data": [
        Flag("model", "model.path", str,
             "local HF model directory (default: the built-in task's tiny warm-started model)"),
        Flag("dataset", "data.train", str, "JSONL/parquet in verl's layout (default: the built-in task)"),
        Flag("task", "data.task", str, "built-in task without --dataset: arithmetic (addition, the default) or "
                                       "calculator (multiplication with a calculator tool: a multi-turn agent loop)"),
        Flag("val_dataset", "data.val", str, "validation JSONL/parquet, scored every data.val_every steps"),
        Flag("reward", "data.reward", str, "module:function, verl's compute_score(data_source, solution_str, "
                                           "ground_truth, extra_info) or (prompt, response); required with --dataset"),
    ],
    "algorithm": [
        Flag("steps", "steps", int, "train steps to run (default 100; 150 for the demo model)"),
        Flag("n", "rollout.n", int, "responses per prompt, the group size (default 8)"),
        Flag("groups_per_step", "trainer.groups_per_batch", int,
             "groups per train step (trainer.groups_per_batch, default 8; 16 in the demo)"),
        Flag("sync_every", "trainer.trigger_parameter_sync_step", int,
             "train steps per weight sync (trainer.trigger_parameter_sync_step, default 1)"),
        Flag("staleness_threshold", "rollout.staleness_threshold", float,
             "extra fraction of a sync's groups the Rollouter may generate ahead "
             "(default 1: the next step's groups while the Trainer trains)"),
        Flag("max_tokens", "rollout.max_tokens", int, "response budget (default: 6 for the built-in task, else 512)"),
        Flag("lr", "trainer.optim.lr", float, "learning rate (default: 1e-3 for the demo model, else 1e-5)"),
        Flag("temperature", "rollout.temperature", float, "sampling temperature (default 1.0)"),
        Flag("mode", "mode", str, "async (default): fully asynchronous; sync: generate a batch, train, sync, in "
                                  "lockstep (on-policy: rollout.staleness_threshold 0, one step per sync)"),
        Flag("partial_rollout", "partial_rollout.enable", str,
             "true: truncate each round's long tail across all engines; truncated responses resume next round "
             "(partial_rollout.enable; see partial_rollout.threshold, max_age)"),
        Flag("long_tail", "data.long_tail", int, "built-in task: response budgets up to this many times the median "
                                                 "(a power of 2; a benchmark workload, the engines then ignore EOS)"),
    ],
    "output": [
        Flag("run_dir", "run_dir", str, "where config.yaml, metrics, the log and checkpoints go (default: runs/<time>)"),
        Flag("seed", "seed", int, "seed (default 0)"),
        Flag("max_restarts", "max_restarts", int, "restart the run from its last checkpoint when a trainer rank or "
                                                  "the Rollouter dies, up to this many times (default 2; 0: stop, "
                                                  "continue with --resume)"),
    ],
}
"""Flags by ``--help`` group."""

ALIASES: dict[str, str] = {f.name: f.key for flags in FLAGS.values() for f in flags}
"""Flag name (``groups_per_step``) -> the dotted key it sets (``trainer.groups_per_batch``)."""

_FLAG_OF = {key: "--" + alias.replace("_", "-") for alias, key in ALIASES.items()}


def named(key: str) -> str:
    """``key`` as a user reads it: the dotted path, and the flag when one sets it."""
    return f"{key} ({_FLAG_OF[key]})" if key in _FLAG_OF else key
