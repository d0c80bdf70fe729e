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


def test_metrics_do_not_import_the_dashboard():
    files = sorted((PACKAGE / "metrics").rglob("*.py"))
    assert len(files) >= 5
    bad = {f.name: sorted(m for m in imported_modules(f) if m.startswith("asyncrl.dashboard")) for f in files}
    assert {k: v for k, v in bad.items() if v} == {}


def test_weight_sync_backends_are_chosen_in_one_place():
    """Only the registry (`sync/backends.py`) imports the backends; `base.py` is the interface they
    import, so nothing imports in a circle."""
    backends = {"asyncrl.sync.broadcast", "asyncrl.sync.vllm", "asyncrl.sync.vllm_broadcast", "asyncrl.sync.inprocess"}
    files = sorted((PACKAGE / "sync").glob("*.py"))
    found = {}
    for f in files:
        if f.name in ("backends.py", "__init__.py"):
            continue
        own = f"asyncrl.sync.{f.stem}"
        # the vLLM worker extension builds the broadcast receiver inside vLLM's worker: it is that backend
        allowed = {"asyncrl.sync.broadcast"} if f.stem == "vllm_broadcast" else set()
        hits = sorted(m for m in imported_modules(f) if m in backends and m != own and m not in allowed)
        if hits:
            found[f.name] = hits
    assert found == {}
    assert not any(m.startswith(tuple(backends)) for m in imported_modules(PACKAGE / "sync" / "base.py"))
