"""Loading user code given as ``module:Name``, and the checks a launcher runs before Ray starts.

Every failure is one `AgentSpecError` line that names the path and what to fix: a module that
does not import, a missing attribute, an `Env` class without ``reset``/``step``, an `AgentLoop`
without ``run``, a chat template that cannot show tools when a `ToolEnv` is used.
"""

from __future__ import annotations

import inspect
from typing import Any

from asyncrl.importpath import load_path


class AgentSpecError(ValueError):
    """User code given by path cannot serve as asked."""


def load_object(path: str, *, field: str = "path") -> Any:
    """``"package.module:Name"`` (or ``"package.module:Outer.Inner"``) -> the object
    (`asyncrl.importpath.load_path`, its errors `AgentSpecError`)."""
    return load_path(path, field, AgentSpecError)


def _require_async_methods(cls: Any, path: str, field: str, names: tuple[str, ...], what: str) -> None:
    if not inspect.isclass(cls):
        raise AgentSpecError(f"{field}={path!r}: is a {type(cls).__name__}, not a class ({what})")
    missing = [n for n in names if not callable(getattr(cls, n, None))]
    if missing:
        raise AgentSpecError(f"{field}={path!r}: class {cls.__name__} has no {', '.join(missing)} method; "
                             f"{what} needs {' and '.join(f'async def {n}(...)' for n in names)}")
    blocking = [n for n in names if not inspect.iscoroutinefunction(getattr(cls, n))]
    if blocking:
        raise AgentSpecError(f"{field}={path!r}: {cls.__name__}.{blocking[0]} must be 'async def' ({what})")
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if abstract:
        raise AgentSpecError(f"{field}={path!r}: class {cls.__name__} leaves {', '.join(abstract)} abstract")


def load_env_class(path: str, *, field: str = "rollout.agent.env") -> type:
    """The `Env` class at ``path``; it needs ``async reset(prompt)`` and ``async step(text)``."""
    cls = load_object(path, field=field)
    _require_async_methods(cls, path, field, ("reset", "step"), "an Env")
    return cls


def load_agent_loop_class(path: str, *, field: str = "rollout.agent.loop") -> type:
    """The `AgentLoop` class at ``path``; it needs ``async run(prompt, llm)``."""
    cls = load_object(path, field=field)
    _require_async_methods(cls, path, field, ("run",), "an AgentLoop")
    return cls


_PROBE_TOOL = {"type": "function", "function": {
    "name": "asyncrl_probe_tool", "description": "probe", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "description": "probe"}}, "required": ["x"]}}}
_PROBE_OUTPUT = "asyncrl-probe-output"


def check_tool_template(tokenizer: Any, *, field: str = "model") -> None:
    """Refuse a tokenizer whose chat template cannot show tools to the model or their results to it.

    Renders a conversation with one probe tool and one tool result: both must appear in the text.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise AgentSpecError(f"{field}: the tokenizer has no chat template; a ToolEnv needs one with tool "
                             "support (a 'tools' section and the 'tool' role)")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
                {"role": "tool", "name": "asyncrl_probe_tool", "content": _PROBE_OUTPUT}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL], tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template error is reported as the template's
        raise AgentSpecError(f"{field}: the chat template fails on tools or a 'tool' message "
                             f"({type(e).__name__}: {e})") from None
    if "asyncrl_probe_tool" not in text:
        raise AgentSpecError(f"{field}: the chat template ignores tools=[...] (no tools section); a ToolEnv "
                             "needs a template with tool support")
    if _PROBE_OUTPUT not in text:
        raise AgentSpecError(f"{field}: the chat template drops 'tool' messages; a ToolEnv needs them rendered")
