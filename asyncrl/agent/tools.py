"""``@tool``: a typed Python function (sync or async) becomes a `Tool` with a JSON schema.

The schema is the one chat templates take (``{"type": "function", "function": {"name",
"description", "parameters"}}``), built by transformers' ``get_json_schema`` from the
function's type hints and its Google-style docstring (``Args:`` describes each parameter).
A function the schema cannot describe is refused at decoration time with one line naming
the function and the parameter: a model cannot call well what it was never told about.

A parameter named ``call_key`` is not shown to the model: the `ToolRunner` fills it with the
call's key, the same when a conversation is generated again after a resume (`CALL_KEY`,
``docs/agent.md``), so a tool with side effects can run them once per key.

A tool returns text. Plain JSON values (numbers, booleans, lists, dicts, None) are written
as JSON; anything else (bytes, objects) is an error observation for that call, not for the
episode (`asyncrl.agent.tool_env`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class ToolDefinitionError(ValueError):
    """A function cannot be made a tool (missing type hint, missing docstring...)."""


class ToolCallError(Exception):
    """A call cannot run or its output is not text; the message becomes the observation."""


CALL_KEY = "call_key"
"""The parameter through which a tool asks for its call's key (asyncrl fills it, the model never sees it)."""

_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
               "array": list, "object": dict}


@dataclass(frozen=True, slots=True)
class Tool:
    """A callable the model may call by name, with the schema the chat template shows it."""

    name: str
    fn: Callable[..., Any]
    schema: dict
    """``{"type": "function", "function": {"name", "description", "parameters"}}``."""
    is_async: bool
    signature: inspect.Signature | None = field(default=None, compare=False, repr=False)
    """``fn``'s signature, taken once (`tool` sets it): ``inspect.signature`` costs more than the
    rest of a call's checks."""
    wants_call_key: bool = False
    """``fn`` has a ``call_key`` parameter: each call gets its key there (`CALL_KEY`)."""

    def bind(self, arguments: Any) -> inspect.BoundArguments:
        """Check the model's ``arguments`` against the signature and the schema's top-level types."""
        if not isinstance(arguments, dict):
            raise ToolCallError(f"arguments of {self.name!r} must be a JSON object, got {type(arguments).__name__}")
        if self.wants_call_key and CALL_KEY in arguments:  # asyncrl's to give, never the model's
            raise ToolCallError(f"bad arguments for {self.name!r}: got an unexpected keyword argument {CALL_KEY!r}")
        try:
            given = {**arguments, CALL_KEY: None} if self.wants_call_key else arguments  # the runner fills it
            bound = (self.signature or inspect.signature(self.fn)).bind(**given)
        except TypeError as e:
            raise ToolCallError(f"bad arguments for {self.name!r}: {e}") from None
        props = self.schema["function"]["parameters"].get("properties", {})
        for key, value in arguments.items():
            expected = _JSON_TYPES.get(props.get(key, {}).get("type"))
            if expected is None:
                continue
            ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
            if not ok:
                raise ToolCallError(f"argument {key!r} of {self.name!r} must be {props[key]['type']}, "
                                    f"got {type(value).__name__}")
        return bound


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None):
    """Make ``fn`` a `Tool` (``@tool`` or ``@tool(name="...")``).

    Raises `ToolDefinitionError` naming the function and parameter when a parameter has no type
    hint, or when the docstring is missing or does not describe a parameter.
    """
    if fn is None:
        return lambda f: tool(f, name=name)
    if isinstance(fn, Tool):
        return fn
    if not callable(fn):
        raise ToolDefinitionError(f"@tool takes a function, got {type(fn).__name__}")
    signature = inspect.signature(fn)
    return Tool(name=name or fn.__name__, fn=fn, schema=_schema(fn, name), is_async=inspect.iscoroutinefunction(fn),
                signature=signature, wants_call_key=CALL_KEY in signature.parameters)


def _shown(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as the model sees it: without its ``call_key`` parameter (a stand-in whose signature
    and hints lack it; its docstring need not describe it)."""
    sig = inspect.signature(fn)
    if CALL_KEY not in sig.parameters:
        return fn

    def shown(*args, **kwargs):  # never called: get_json_schema reads it
        raise NotImplementedError

    shown.__name__, shown.__qualname__, shown.__doc__ = fn.__name__, getattr(fn, "__qualname__", fn.__name__), fn.__doc__
    shown.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != CALL_KEY])
    shown.__annotations__ = {k: v for k, v in getattr(fn, "__annotations__", {}).items() if k != CALL_KEY}
    shown.__wrapped__ = fn  # string annotations resolve in fn's module (typing.get_type_hints unwraps)
    return shown


def _schema(fn: Callable[..., Any], name: str | None) -> dict:
    qual = getattr(fn, "__qualname__", repr(fn))
    fn = _shown(fn)
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ToolDefinitionError(f"@tool {qual}: parameter {p.name!r} is *args/**kwargs; "
                                      "a tool takes named, typed parameters only")
        if p.annotation is inspect.Parameter.empty:
            raise ToolDefinitionError(f"@tool {qual}: parameter {p.name!r} has no type hint; annotate it "
                                      f"(e.g. {p.name}: str) so the model is told what to pass")
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    try:
        schema = get_json_schema(fn)
    except DocstringParsingException as e:
        raise ToolDefinitionError(f"@tool {qual}: {e} (write a docstring whose 'Args:' section describes "
                                  "every parameter)") from None
    except TypeHintParsingException as e:
        raise ToolDefinitionError(f"@tool {qual}: {e}") from None
    schema["function"].pop("return", None)
    if name:
        schema["function"]["name"] = name
    return schema


def as_text(name: str, value: Any) -> str:
    """A tool's return value as observation text; `ToolCallError` when it is not text or JSON."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bool, int, float, list, dict)):
        try:
            return json.dumps(value)
        except (TypeError, ValueError) as e:
            raise ToolCallError(f"tool {name!r} returned a {type(value).__name__} that is not JSON ({e})") from None
    raise ToolCallError(f"tool {name!r} returned {type(value).__name__}; a tool must return text (str) "
                        "or a JSON value")
