"""Preset defaults: where a run's default differs from the parts' own, by what the run is.

Each table maps dotted keys to values; `presets_for` picks the tables that apply, and the user's
YAML files and overrides win over all of them. Why each value was chosen, with the runs behind
it, is in the docs each table names (no figures live here).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

RUN_DEFAULTS = {"rollout.staleness_threshold": 1.0}
"""Every run: the Rollouter works one sync ahead, so the next step is generated while the Trainer
trains (the Rollouter alone defaults to on-policy)."""
SYNC_MODE_DEFAULTS = {"rollout.staleness_threshold": 0.0, "partial_rollout.truncate_at": "threshold"}
"""``mode=sync`` is on-policy: no run-ahead unless the user asks for it (then `check` refuses);
with partial rollout, rounds end at the step's groups (the RFC's workflow)."""
SYNC_PARTIAL_DEFAULTS = {"rollout.max_concurrent": ("${asyncrl.mul:2,${trainer.groups_per_batch},"
                                                     "${trainer.require_batches},${trainer.trigger_parameter_sync_step}}")}
"""``mode=sync`` with partial rollout: a round keeps twice the step's prompts in flight (the RFC's
over-provisioned batch), so the step's groups are its fastest ones (docs/partial_rollout.md)."""
DEMO_DEFAULTS = {"trainer.optim.lr": 1e-3, "steps": 150, "trainer.groups_per_batch": 16}
"""No model given: the tiny demo model learns at a high rate, with 16 groups per step for a
steadier gradient (docs/demo.md)."""
BUILTIN_TASK_DEFAULTS = {"rollout.max_tokens": 6}
"""No dataset given: the built-in task's answers are a few tokens."""
CALCULATOR_TASK_DEFAULTS = {
    "rollout.agent.env": "asyncrl.tasks.calculator:CalculatorEnv",
    "rollout.agent.max_turns": 3,
    "rollout.agent.max_tokens_per_turn": 64,
    "rollout.agent.max_context_tokens": 256,
    "rollout.agent.kwargs": {"latency_median_s": 0.0, "latency_p99_s": None, "seed": "${seed}"},
    "rollout.agent.tool_concurrency": 1024,
}
"""``data.task=calculator`` (``--task calculator``): its env, the conversation's limits (question,
tool call, result, answer), the tool's latency (none; set ``rollout.agent.kwargs.latency_median_s``
/ ``latency_p99_s`` for a long tail; the tool awaits its latency, so calls need not queue)."""
CALCULATOR_DEMO_DEFAULTS = {"trainer.optim.lr": 5e-5, "steps": 60}
"""``data.task=calculator`` with its shipped model: a lower rate than the addition demo's, which
breaks the tool calls' JSON (docs/agent.md)."""
REAL_DEFAULTS = {"rollout.max_tokens": 512}
"""A dataset given: responses of a real task."""


def presets_for(user: DictConfig) -> dict[str, Any]:
    """The preset values (dotted key -> value) for a run whose merged settings are ``user``."""
    def given(key: str) -> Any:
        return OmegaConf.select(user, key)

    presets = dict(RUN_DEFAULTS)
    if given("model.path") is None:
        presets.update(DEMO_DEFAULTS)
    builtin = given("data.train") is None
    presets.update(BUILTIN_TASK_DEFAULTS if builtin else REAL_DEFAULTS)
    if builtin and given("data.task") == "calculator":
        presets.update(CALCULATOR_TASK_DEFAULTS)
        if any(given(f"rollout.agent.{k}") is not None for k in ("loop", "function", "command")):
            # The user's own agent: the task gives its rows and reward, not its env (or the env's kwargs).
            del presets["rollout.agent.env"], presets["rollout.agent.kwargs"]
        elif given("rollout.agent.env") not in (None, CALCULATOR_TASK_DEFAULTS["rollout.agent.env"]):
            del presets["rollout.agent.kwargs"]  # the user's own env: built with its own kwargs, not the task env's
        if given("model.path") is None:
            presets.update(CALCULATOR_DEMO_DEFAULTS)
    if given("mode") == "sync":
        presets.update(SYNC_MODE_DEFAULTS)
        if given("partial_rollout.enable"):
            presets.update(SYNC_PARTIAL_DEFAULTS)
    return presets
