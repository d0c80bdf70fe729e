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
    import, so nothing imports in a circle. A backend may be a subpackage and import its own files."""
    backends = ("asyncrl.sync.broadcast", "asyncrl.sync.vllm", "asyncrl.sync.vllm_broadcast", "asyncrl.sync.inprocess")

    def backend_of(module: str) -> str | None:
        return next((b for b in backends if module == b or module.startswith(b + ".")), None)

    sync = PACKAGE / "sync"
    files = sorted(sync.rglob("*.py"))
    assert {f.parent.name for f in files} >= {"sync", "broadcast", "vllm"}  # the subpackages are checked too
    found = {}
    for f in files:
        if f in (sync / "backends.py", sync / "__init__.py"):
            continue
        rel = f.relative_to(PACKAGE).with_suffix("")
        own = backend_of(".".join(("asyncrl", *rel.parts[:-1], *([] if rel.name == "__init__" else [rel.name]))))
        # the vLLM worker extension builds the broadcast receiver inside vLLM's worker: it is that backend
        allowed = {"asyncrl.sync.broadcast"} if own == "asyncrl.sync.vllm_broadcast" else set()
        hits = sorted(m for m in imported_modules(f) if backend_of(m) not in (None, own, *allowed))
        if hits:
            found[str(f.relative_to(PACKAGE))] = hits
    assert found == {}
    assert not any(backend_of(m) for m in imported_modules(sync / "base.py"))


def test_no_module_or_function_of_weight_sync_outgrows_its_size():
    """STYLE.md sizes for `asyncrl/sync/` and its backends' subpackages: modules <= 400 lines,
    functions < 60 (counted as for the Rollouter)."""
    files = sorted((PACKAGE / "sync").rglob("*.py"))
    assert len(files) >= 15  # the interface, registry, coordinator and every backend's files
    too_long = {}
    for f in files:
        src = f.read_text()
        if len(src.splitlines()) > 400:
            too_long[str(f.relative_to(PACKAGE))] = len(src.splitlines())
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                too_long[f"{f.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert too_long == {}


ENGINES = PACKAGE / "rollouter" / "engines"
ENGINE_BACKENDS = ("asyncrl.rollouter.engines.builtin", "asyncrl.rollouter.engines.vllm", "asyncrl.rollouter.engines.sim")


def _own_backend(path: Path) -> str | None:
    """The backend a file of the engines package belongs to (it may import its own files)."""
    rel = path.relative_to(ENGINES).with_suffix("")
    name = "asyncrl.rollouter.engines." + ".".join(rel.parts)
    return next((b for b in ENGINE_BACKENDS if name == b or name.startswith(b + ".")), None)


def test_engines_import_nothing_of_the_rollout_control():
    """The engines serve requests and take weights; the Rollouter, EngineActor, aggregator and
    partial buffer drive them from outside (`asyncrl.rollouter.*` outside `engines/`)."""
    files = sorted(ENGINES.rglob("*.py"))
    assert len(files) >= 12  # base, backends, builtin's six files, vllm's three, sim
    bad = {}
    for f in files:
        hits = sorted(m for m in imported_modules(f)
                      if m.startswith("asyncrl.rollouter") and not m.startswith("asyncrl.rollouter.engines"))
        if hits:
            bad[str(f.relative_to(PACKAGE))] = hits
    assert bad == {}


def test_engine_backends_are_chosen_in_one_place():
    """Only the registry (`engines/backends.py`) imports the backends, in the whole package; a
    backend imports the interface (`engines/base.py`) and its own files."""
    found = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        if f == ENGINES / "backends.py" or f.name == "__init__.py" and f.parent == ENGINES:
            continue
        own = _own_backend(f) if f.is_relative_to(ENGINES) else None
        hits = sorted(m for m in imported_modules(f)
                      if m.startswith(ENGINE_BACKENDS) and (own is None or not m.startswith(own)))
        if hits:
            found[str(f.relative_to(PACKAGE))] = hits
    assert found == {}
    assert not any(m.startswith(ENGINE_BACKENDS) for m in imported_modules(ENGINES / "base.py"))


def test_no_module_or_function_of_the_rollouter_outgrows_its_size():
    """STYLE.md: around 400 lines a module is a sign to split, a function over 60 hides two."""
    too_long = {}
    for f in sorted((PACKAGE / "rollouter").rglob("*.py")):
        src = f.read_text()
        if len(src.splitlines()) > 400:
            too_long[str(f.relative_to(PACKAGE))] = len(src.splitlines())
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                too_long[f"{f.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert too_long == {}


def test_the_call_layer_is_split_by_concern_and_shares_the_streams_pump():
    """`asyncrl.rpc` is a package of small modules (STYLE.md sizes), and one socket pump
    (`asyncrl.pump`) drives both the calls' sockets and the sample stream's."""
    files = sorted((PACKAGE / "rpc").glob("*.py")) + [PACKAGE / "pump.py"]
    assert {f.stem for f in files} >= {"server", "client", "auth", "liveness", "wire", "pump"}
    too_long = {}
    for f in files:
        src = f.read_text()
        if len(src.splitlines()) > 400:
            too_long[str(f.relative_to(PACKAGE))] = len(src.splitlines())
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                too_long[f"{f.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert too_long == {}
    assert not (PACKAGE / "rpc.py").exists()
    for user in ("rpc/server.py", "rpc/client.py", "queue/transport.py"):
        assert "asyncrl.pump" in imported_modules(PACKAGE / user), user
    assert not any("pickle" in m for f in files for m in imported_modules(f))  # no pickle on the calls' wire
