"""Agent loops: multi-turn, tool-using rollouts (DESIGN.md, "Agent loops"; docs/agent.md).

``Env`` + ``Step`` (a user's environment, driven by `EnvLoop`), ``AgentLoop`` (a user's loop,
full control), ``@tool`` and ``ToolEnv`` (tools called in the Hermes/Qwen ``<tool_call>`` format).

Names are imported lazily so ``import asyncrl.agent`` needs neither torch nor ray.
"""

from __future__ import annotations

from asyncrl._lazy import lazy_exports

_EXPORTS = {
    "Env": "asyncrl.agent.base",
    "Step": "asyncrl.agent.base",
    "AgentLoop": "asyncrl.agent.base",
    "AgentTrajectory": "asyncrl.agent.base",
    "LLM": "asyncrl.agent.base",
    "Turn": "asyncrl.agent.base",
    "OBSERVATION_VERSION": "asyncrl.agent.base",
    "tool": "asyncrl.agent.tools",
    "Tool": "asyncrl.agent.tools",
    "ToolDefinitionError": "asyncrl.agent.tools",
    "ToolEnv": "asyncrl.agent.tool_env",
    "ToolRunner": "asyncrl.agent.tool_env",
    "ToolRunnerConfig": "asyncrl.agent.limits",
    "HermesParser": "asyncrl.agent.parsers",
    "ToolCall": "asyncrl.agent.parsers",
    "ToolCallParser": "asyncrl.agent.parsers",
    "EnvLoop": "asyncrl.agent.loop",
    "EnvLoopConfig": "asyncrl.agent.limits",
    "SingleTurnLoop": "asyncrl.agent.loop",
    "ChatRenderer": "asyncrl.agent.render",
    "PlainRenderer": "asyncrl.agent.render",
    "EngineLLM": "asyncrl.agent.llm",
    "AgentSpecError": "asyncrl.agent.loading",
    "load_object": "asyncrl.agent.loading",
    "load_env_class": "asyncrl.agent.loading",
    "load_agent_loop_class": "asyncrl.agent.loading",
    "check_tool_template": "asyncrl.agent.loading",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
