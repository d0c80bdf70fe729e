"""``module:name`` -> the object: the one loader behind every setting that names code by path (the
reward, the group filter, an agent's env / loop / function, a metric sink, a weight-sync backend).

Every failure is one line of the same shape, naming the setting, the module and the name::

    rollout.group_filter='mymod:keep': module 'mymod' does not import (ModuleNotFoundError: ...)
    data.reward='mymod:score': module 'mymod' has no callable 'score'
"""

from __future__ import annotations

import importlib
from typing import Any


def split_path(spec: str, setting: str, error: type[Exception] = ValueError) -> tuple[str, str]:
    """``"package.module:Name"`` -> ``("package.module", "Name")``; ``error`` naming ``setting``
    when ``spec`` is not of that shape (exactly one colon, both sides given)."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise error(f"{setting}={spec!r}: expected 'module:Name' (e.g. mypkg.mymodule:MyName)")
    module, name = spec.split(":")
    return module, name


def load_path(spec: str, setting: str, error: type[Exception] = ValueError, *, want_callable: bool = False) -> Any:
    """The object ``spec`` (``module:Name``, or ``module:Outer.Inner``) names; ``error`` (its message
    led by ``setting=spec``) when ``spec`` is malformed, the module does not import, the name is
    not in it, or (``want_callable``) it is not callable."""
    module, name = split_path(spec, setting, error)
    lead = f"{setting}={spec!r}: module {module!r}"
    try:
        obj: Any = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - any import-time failure of the named module, in one line
        raise error(f"{lead} does not import ({type(e).__name__}: {e})") from None
    for part in name.split("."):
        if not hasattr(obj, part):
            raise error(f"{lead} has no {'callable' if want_callable else 'attribute'} {part!r}")
        obj = getattr(obj, part)
    if want_callable and not callable(obj):
        raise error(f"{lead} has no callable {name!r} (its value is of type {type(obj).__name__})")
    return obj
