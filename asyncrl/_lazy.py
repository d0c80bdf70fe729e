"""Lazy package exports: ``import asyncrl.x`` stays cheap until a name is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], object], list[str]]:
    """A module ``__getattr__`` importing ``exports[name]`` on first use, and the ``__all__`` list."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__, sorted(exports)
