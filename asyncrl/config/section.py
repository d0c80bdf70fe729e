"""`section_of`: a run config section made from its owners' dataclasses, less what the run decides."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any


def section_of(name: str, owners: tuple[type, ...], *, module: str, doc: str, leave_out: frozenset[str] | set[str],
               defaults: dict[str, Any] | None = None, types: dict[str, type] | None = None,
               validate: bool | Callable[[Any], None] = False,
               take: Mapping[type, Collection[str]] | None = None) -> type:
    """A dataclass with the owners' fields, types and defaults, less ``leave_out`` (set by the run).

    ``take`` names, for an owner, the only fields taken from it; a field name is taken once, from
    the first owner that gives it (`asyncrl.configref` documents it from that owner). ``defaults``
    replaces a field's default, ``types`` a nested section's type (built by its default
    constructor). With ``validate`` (one owner) the section builds its owner once, so the owner's
    own checks run when the section is loaded; a function given instead is the section's
    ``__post_init__``. ``module`` must hold the section under ``name`` (pickling finds it there).
    """
    defaults, types, take = defaults or {}, types or {}, take or {}
    fields, homes = [], {}
    for owner in owners:
        hints = typing.get_type_hints(owner)
        for f in dataclasses.fields(owner):
            if f.name in leave_out or f.name in homes or (owner in take and f.name not in take[owner]):
                continue
            homes[f.name] = owner
            if f.name in types:
                hint, spec = types[f.name], dataclasses.field(default_factory=types[f.name])
            elif f.default_factory is not dataclasses.MISSING:
                hint, spec = hints[f.name], dataclasses.field(default_factory=f.default_factory)
            else:
                hint, spec = hints[f.name], dataclasses.field(default=defaults.get(f.name, f.default))
            fields.append((f.name, hint, spec))
    if callable(validate):
        namespace = {"__post_init__": validate}
    else:
        namespace = {"__post_init__": lambda self: owners[0](**values(self))} if validate else {}
    section = dataclasses.make_dataclass(name, fields, kw_only=True, namespace=namespace)
    section.__module__, section.__doc__ = module, doc
    section.__config_homes__ = homes  # field -> the owner it came from (its docstring is there)
    return section


def values(section: Any) -> dict[str, Any]:
    """A section's fields by name (shallow: nested sections stay objects)."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
