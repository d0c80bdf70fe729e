"""`RolloutConfig`: the Rollouter's settings (the ``rollout`` section of the run's config), and
`AgentConfig` (``rollout.agent``: the agent loop each response runs, if any)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.agent.limits import EnvLoopConfig, ToolRunnerConfig


@dataclass(kw_only=True)
class AgentSource:
    """What runs each episode of ``rollout.agent`` (the first keys of `AgentConfig`)."""

    env: str | None = None
    """``module:Class`` of an `asyncrl.agent.Env` (built with ``kwargs``, one per episode);
    asyncrl's `EnvLoop` drives it with the model's chat template."""
    loop: str | None = None
    """``module:Class`` of an `asyncrl.agent.AgentLoop` (built with ``kwargs``, once per process):
    full control over each episode. Set one of ``env``, ``loop``, ``function``, ``command``."""
    function: str | None = None
    """``module:function`` of an OpenAI-client agent, ``async def agent(row, client) -> float | None``,
    called once per episode against its own endpoint (`asyncrl.agent.endpoint`, docs/endpoint.md)."""
    command: str | None = None
    """A command run once per episode (``python path/agent.py``) with ``OPENAI_BASE_URL``,
    ``OPENAI_API_KEY``, ``OPENAI_MODEL``, ``ASYNCRL_EPISODE_KEY`` set and the row on stdin as JSON (docs/endpoint.md)."""
    endpoint_host: str = "127.0.0.1"
    """Address the endpoint binds (``function`` / ``command``); loopback unless agents run on other hosts."""
    endpoint_port: int = 0
    """Port of the endpoint; 0: any free one."""
    endpoint_model: str = "policy"
    """The model name the endpoint lists and an agent is told (``OPENAI_MODEL``)."""
    endpoint_max_episode_s: float = 600.0
    """Wall time of one endpoint episode; past it the agent is stopped and its group fails."""
    endpoint_forks_path: str | None = None
    """JSONL file each endpoint fork's first differing message is appended to (the launcher sets
    ``<run_dir>/endpoint_forks.jsonl``); None: logged."""
    endpoint_server: str = "process"
    """Where the endpoint and a function agent run: ``process`` (a process of its own next to the
    Rollouter: the Rollouter's event loop keeps only the engine calls) or ``loop`` (the Rollouter's
    event loop: no IPC, less CPU per call, its loop lag grows with the calls in flight; docs/endpoint.md)."""
    endpoint_branches: str = "all"
    """Which branches of an endpoint episode are trained: ``all`` (each its own trajectory with the
    episode's reward and advantage; a group then holds n or more) or ``main`` (the last call's only)."""


@dataclass(kw_only=True)
class AgentConfig(ToolRunnerConfig, EnvLoopConfig, AgentSource):
    """``rollout.agent``: run each response as an agent loop (`asyncrl.rollouter.agents`).

    None of ``env``, ``loop``, ``function``, ``command`` set (the default): plain single-turn generation.
    The episode limits and tool settings are `EnvLoopConfig`'s and `ToolRunnerConfig`'s fields
    (`asyncrl.agent.limits`): a run gives this record to its `EnvLoop` and `ToolRunner` as it is."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments ``env`` or ``loop`` is built with (e.g. a tool's settings; ``--task
    calculator`` sets the calculator's latency here)."""
    sessions: int = 1
    """Trajectories every run of the loop returns (a multi-output `AgentLoop`): a group holds
    ``n * sessions``; a run that returns another count fails its group (`SessionCountError`)."""

    def __post_init__(self) -> None:
        if self.env is not None and self.loop is not None:
            raise ValueError(f"AgentConfig.env ({self.env!r}) is set and so is rollout.agent.loop ({self.loop!r}): "
                             "set one of them (an Env is driven by asyncrl's EnvLoop; a loop is your own)")
        given = [k for k in ("env", "loop", "function", "command") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"AgentConfig: rollout.agent.{given[0]} and rollout.agent.{given[1]} are both set: set one "
                             "(function/command: an OpenAI-client agent behind the endpoint, docs/endpoint.md)")
        if self.function is not None and not _is_path(self.function):
            raise ValueError(f"AgentConfig.function must be module:function, got {self.function!r}")
        if self.command is not None and not self.command.strip():
            raise ValueError("AgentConfig.command is empty: give the command line that runs one episode")
        if not self.endpoint_max_episode_s > 0:
            raise ValueError(f"AgentConfig.endpoint_max_episode_s must be > 0, got {self.endpoint_max_episode_s}")
        if self.endpoint_server not in ("process", "loop"):
            raise ValueError(f"AgentConfig.endpoint_server must be process or loop, got {self.endpoint_server!r}")
        if self.endpoint_branches not in ("all", "main"):
            raise ValueError(f"AgentConfig.endpoint_branches must be all or main, got {self.endpoint_branches!r}")
        self.check_episode_limits()
        self.check_tool_settings()
        if self.sessions < 1:
            raise ValueError(f"AgentConfig.sessions must be >= 1, got {self.sessions}")
        if self.sessions != 1 and self.loop is None:
            raise ValueError(f"AgentConfig.sessions={self.sessions}: only an AgentLoop (rollout.agent.loop) "
                             "returns several trajectories per run")

    @property
    def enabled(self) -> bool:
        """An agent loop runs each response (else plain single-turn generation)."""
        return any(getattr(self, k) is not None for k in ("env", "loop", "function", "command"))

    @property
    def endpoint(self) -> bool:
        """An OpenAI-client agent (``function`` / ``command``) behind the endpoint runs each response."""
        return self.function is not None or self.command is not None

    @property
    def spec(self) -> str:
        """What the config named, as ``rollout.agent.<field>=<value>`` (for errors and the skip shape)."""
        field_ = next((k for k in ("env", "loop", "function", "command") if getattr(self, k) is not None), None)
        return f"rollout.agent.{field_}={getattr(self, field_)}" if field_ else ""


def _is_path(spec: str) -> bool:
    module, sep, name = spec.partition(":")
    return bool(sep and module and name)


@dataclass(kw_only=True)
class RolloutConfig:
    """Settings of the Rollouter."""

    n: int = 8
    """Responses per prompt (the group size)."""
    max_tokens: int = 8
    """Response budget per request (a prompt may carry its own, `Prompt.max_tokens`); an agent loop's
    turns have their own (``agent.max_tokens_per_turn``, or what the loop asks)."""
    temperature: float = 1.0
    """Sampling temperature (behaviour logprobs are taken after it)."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 disables it."""
    top_k: int = 0
    """Top-k sampling; 0 disables it."""
    groups_per_sync: int = 8
    """Groups the Trainer consumes between two weight syncs (`TrainerConfig.groups_per_sync`); a run passes
    the Trainer's in (`RunConfig.rollout_config`): it is no key of the run's ``rollout`` section."""
    staleness_threshold: float = 0.0
    """Extra fraction of ``groups_per_sync`` that may be generated ahead of the next sync."""
    max_concurrent: int = 16
    """Prompts in flight at once across all engines."""
    request_timeout_s: float = 600.0
    """Deadline of one generate call, not counting weight-sync pauses; past it the request is
    aborted on its engine and fails its group."""
    reward_workers: int = 4
    """Threads that run a synchronous reward function (an async one is awaited instead)."""
    result_batch_s: float | None = 0.02
    """A replica streams a group call's results back, those that end within this many seconds of
    each other in one message (0: a message per response), so each response's reward starts at most
    this late. None: one plain call answered when the group's last response ends (rewards start
    then; the cheapest for the Rollouter: a streaming call costs it ~3x a plain one, docs/scale.md)."""
    engine_calls: str = "zmq"
    """How the Rollouter, the weight-sync coordinator and the aggregator call engine replicas that
    are Ray actors: ``zmq`` (over a ZeroMQ socket pair, Ray placing and watching the actor:
    `asyncrl.rpc`; loopback on the replica's node, CURVE-encrypted from another; a fraction of a
    Ray call's CPU) or ``ray`` (Ray actor calls)."""
    seed: int = 0
    """Base seed; request ``k`` of sample ``i`` samples with ``seed + 1000 * i + k`` (+ its age)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """The agent loop each response runs (``rollout.agent.env`` / ``rollout.agent.loop``); none by default."""
    group_filter: str = "none"
    """Dynamic sampling (`asyncrl.rollouter.filters`): ``none``; ``zero_std`` (drop a group whose
    rewards are all equal: GRPO learns nothing from it); or ``module:function`` taking a `GroupView`
    and returning True to keep the group. Dropped groups are not trained, are recorded as dropped
    (reason ``filtered``), and give their staleness budget back so another prompt takes their place."""
    max_filtered_in_a_row: int = 64
    """Groups the filter may drop in a row before the run stops with an error naming it."""
    on_user_error: str = "stop"
    """When the user's env, agent loop, reward function or group filter raises (`asyncrl.usercode`):
    ``stop`` the run at once, naming the prompt, with the traceback (no restart: it would raise
    again); ``drop`` the group, count it (``user_errors/dropped_groups``) and print the first error."""

    def __post_init__(self) -> None:
        for name in ("n", "max_tokens", "groups_per_sync", "max_concurrent", "reward_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.staleness_threshold < 0:
            raise ValueError(f"RolloutConfig.staleness_threshold must be >= 0, got {self.staleness_threshold}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"RolloutConfig.request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.max_filtered_in_a_row < 1:
            raise ValueError(f"RolloutConfig.max_filtered_in_a_row must be >= 1, got {self.max_filtered_in_a_row}")
        module, sep, name = self.group_filter.partition(":")
        if self.group_filter not in ("none", "zero_std") and not (sep and module and name):
            raise ValueError(f"RolloutConfig.group_filter must be none, zero_std or module:function, "
                             f"got {self.group_filter!r}")
        if self.on_user_error not in ("stop", "drop"):
            raise ValueError(f"RolloutConfig.on_user_error must be stop or drop, got {self.on_user_error!r}")
        if self.engine_calls not in ("zmq", "ray"):
            raise ValueError(f"RolloutConfig.engine_calls must be zmq or ray, got {self.engine_calls!r}")
        if self.result_batch_s is not None and self.result_batch_s < 0:
            raise ValueError(f"RolloutConfig.result_batch_s must be >= 0, got {self.result_batch_s}")
