"""Agents written against the OpenAI API, trained unchanged by asyncrl (docs/agent_stacks.md).

Importable from the repository root (``examples.openai_agent.agent:run``), so the launcher's
``rollout.agent.function`` finds them when started there."""
