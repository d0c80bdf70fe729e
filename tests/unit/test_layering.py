"""Package layering: the Trainer's package does not import the Rollouter's or the tasks
(the on-policy lockstep is the launcher's ``--mode sync``, not a loop inside ``trainer/``)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "asyncrl"


def imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_trainer_imports_neither_rollouter_nor_tasks():
    files = sorted((PACKAGE / "trainer").glob("*.py"))
    assert len(files) >= 8  # the package is there to be checked
    bad = {f.name: sorted(m for m in imported_modules(f) if m.startswith(("asyncrl.rollouter", "asyncrl.tasks")))
           for f in files}
    assert {k: v for k, v in bad.items() if v} == {}
