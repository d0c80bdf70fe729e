"""SkipManager: cache and replay pipeline stages (today: rollouts) per step.

Roles are `BaseSkip` subclasses registered with `register_skip`; functions are attached with
``@SkipManager.annotate(role=...)``; `SkipManager.init(config, shape=...)` turns the enabled
roles on in this process. Built in: ``rollout`` (`RolloutSkip`, step from `SkipManager.set_step`)
and ``async_rollout`` (`AsyncRolloutSkip`, step from each call's ``sample_id``). Config:
`SkipConfig` (``skip.experiment``, ``skip.<role>.{enable, dump_dir, steps, action}``). Dumps:
`asyncrl.skip.store` (codec-encoded, atomic, keyed by experiment and shape).
"""

from asyncrl.skip.config import SkipAction, SkipConfig, SkipRoleConfig, absolute_dump_dirs, load_skip_config
from asyncrl.skip.manager import BaseSkip, SkipCall, SkipManager, register_skip
from asyncrl.skip.rollout_skip import REPLAY_KEY, AsyncRolloutSkip, RolloutSkip, is_replayed, rebase_versions
from asyncrl.skip.shape import model_fingerprint, prompts_fingerprint, rollout_shape
from asyncrl.skip.store import DumpError, DumpKey, DumpStore

__all__ = [
    "REPLAY_KEY",
    "AsyncRolloutSkip",
    "BaseSkip",
    "DumpError",
    "DumpKey",
    "DumpStore",
    "RolloutSkip",
    "SkipAction",
    "SkipCall",
    "SkipConfig",
    "SkipManager",
    "SkipRoleConfig",
    "absolute_dump_dirs",
    "is_replayed",
    "load_skip_config",
    "model_fingerprint",
    "prompts_fingerprint",
    "rebase_versions",
    "register_skip",
    "rollout_shape",
]
