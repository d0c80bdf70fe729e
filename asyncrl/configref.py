"""The config reference, generated from the config dataclasses: every key, its type, default and docstring.

``python -m asyncrl.configref > docs/config.md`` writes the Markdown reference;
``python -m asyncrl.launch --help-config [SECTION]`` prints the same keys as text. Only
`asyncrl.config` and the sections it composes are imported (no torch, no Ray), so both are quick.
A field's docstring is the string literal that follows it in its class body (``ast``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class Key:
    """One setting: its dotted path, type, default (as YAML-ish text) and docstring (one line)."""

    path: str
    type: str
    default: str
    doc: str


@dataclass(frozen=True)
class Section:
    path: str  # "" for the root
    doc: str
    keys: tuple[Key, ...]


@lru_cache(maxsize=None)
def _field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it, over the class and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # made by make_dataclass: no source of its own
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _origin_docs(cls: type) -> dict[str, str]:
    """Docstrings of a class built by `asyncrl.config.section.section_of`: from its fields' home classes."""
    docs = dict(_field_docs(cls))
    for name, home in getattr(cls, "__config_homes__", {}).items():
        if name in _field_docs(home):
            docs.setdefault(name, _field_docs(home)[name])
    return docs


def _type_text(f: dataclasses.Field, cls: type) -> str:
    # A section made from its owners has their resolved types; the owner's annotation reads better.
    home = getattr(cls, "__config_homes__", {}).get(f.name)
    t = home.__dataclass_fields__[f.name].type if home is not None else f.type
    t = t if isinstance(t, str) else getattr(t, "__name__", repr(t))
    return t.replace("typing.", "")


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if not isinstance(value, str) else value or '""'


def sections(root: type | None = None) -> list[Section]:
    """Every section of `RunConfig` (the root first, then depth first), each with its leaf keys."""
    from asyncrl.config import DERIVED, RUN_DEFAULTS, RunConfig

    out: list[Section] = []

    def default(f: dataclasses.Field, path: str) -> str:
        if path in DERIVED:
            return DERIVED[path]
        if path in RUN_DEFAULTS:
            return repr(RUN_DEFAULTS[path])
        return _default_text(f)

    def walk(cls: type, prefix: str) -> None:
        docs = _origin_docs(cls)
        keys, subs = [], []
        for f in dataclasses.fields(cls):
            path = f"{prefix}.{f.name}" if prefix else f.name
            sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
            if sub is not None and dataclasses.is_dataclass(sub):
                subs.append((sub, path))
            else:
                keys.append(Key(path, _type_text(f, cls), default(f, path), docs.get(f.name, "")))
        doc = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
        out.append(Section(prefix, doc, tuple(keys)))
        for sub, path in subs:
            walk(sub, path)

    walk(root or RunConfig, "")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """The reference as Markdown: one table per section (docs/config.md)."""
    lines = ["# Config reference", "",
             "Every setting of `python -m asyncrl.launch`, generated from the config dataclasses by",
             "`python -m asyncrl.configref > docs/config.md` (a test fails when this file is stale).",
             "Set a key in a `--config` YAML file or as a dotted override (`trainer.optim.lr=1e-6`);",
             "`python -m asyncrl.launch --help-config SECTION` prints one section, `--print-config`",
             "the resolved values of a run. A default `${...}` follows from other keys unless given",
             "(`asyncrl.mul`, `max`, `min` are products, maxima and minima). With no `--model` the demo",
             "model's defaults apply (`steps` 150, `trainer.optim.lr` 1e-3, `trainer.groups_per_batch` 16;",
             "`--task calculator`: 60 steps at 5e-5), and `mode=sync` sets `rollout.staleness_threshold` 0.", ""]
    for s in sections():
        lines += [f"## `{s.path}`" if s.path else "## top level", ""]
        if s.doc:
            lines += [s.doc, ""]
        if not s.keys:
            continue
        lines += ["| key | type | default | what it does |", "| --- | --- | --- | --- |"]
        lines += [f"| `{k.path}` | `{_cell(k.type)}` | `{_cell(k.default)}` | {_cell(k.doc)} |" for k in s.keys]
        lines.append("")
    return "\n".join(lines)


def text(section: str = "") -> str:
    """The keys under ``section`` (a dotted prefix; "" = all) as plain text, for ``--help-config``.

    Raises KeyError naming the sections when none matches."""
    chosen = [s for s in sections() if not section or s.path == section or s.path.startswith(section + ".")]
    if not chosen:
        names = ", ".join(s.path for s in sections() if s.path)
        raise KeyError(f"no config section {section!r}; sections: {names}")
    lines: list[str] = []
    for s in chosen:
        lines.append(f"[{s.path or 'top level'}]" + (f"  {s.doc}" if s.doc else ""))
        for k in s.keys:
            lines.append(f"  {k.path}: {k.type} = {k.default}")
            lines += textwrap.wrap(k.doc, width=96, initial_indent="      ", subsequent_indent="      ")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown())
