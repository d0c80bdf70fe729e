"""`section_of`: a run config section made from its owners' dataclasses, less what the run decides."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any


def section_of(name: str, owners: tuple[type, ...], *, module: str, doc: str, leave_out: frozenset[str] | set[str],
               defaults: dict[str, Any] | None = None, types: dict[str, type] | None = None,
               validate: bool = False) -> type:
    """A dataclass with the owners' fields, types and defaults, less ``leave_out`` (set by the run).

    ``defaults`` replaces a field's default, ``types`` a nested section's type (built by its
    default constructor). With ``validate`` (one owner) the section builds its owner once, so the
    owner's own checks run when the section is loaded. ``module`` must hold the section under
    ``name`` (pickling finds it there); `asyncrl.configref` reads field docstrings from the owners.
    """
    defaults, types = defaults or {}, types or {}
    fields = []
    for owner in owners:
        hints = typing.get_type_hints(owner)
        for f in dataclasses.fields(owner):
            if f.name in leave_out:
                continue
            if f.name in types:
                hint, spec = types[f.name], dataclasses.field(default_factory=types[f.name])
            elif f.default_factory is not dataclasses.MISSING:
                hint, spec = hints[f.name], dataclasses.field(default_factory=f.default_factory)
            else:
                hint, spec = hints[f.name], dataclasses.field(default=defaults.get(f.name, f.default))
            fields.append((f.name, hint, spec))
    namespace = {"__post_init__": lambda self: owners[0](**values(self))} if validate else {}
    section = dataclasses.make_dataclass(name, fields, kw_only=True, namespace=namespace)
    section.__module__, section.__doc__ = module, doc
    section.__config_origins__ = owners
    return section


def values(section: Any) -> dict[str, Any]:
    """A section's fields by name (shallow: nested sections stay objects)."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
