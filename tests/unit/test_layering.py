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


# --- The import graph: no circle anywhere --------------------------------------------------------

ROOT = PACKAGE.parent
SCRIPTS = ROOT / "scripts"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _lazy_exports(init: Path, package: str) -> dict[str, str]:
    """The names a package's ``__init__`` imports lazily (`asyncrl._lazy`, or `asyncrl.config`'s own
    ``_EXPORTS`` / ``_PARTS``), each with the module that defines it: an import of such a name is an
    arrow to that module, not to the package."""
    out = {}
    for node in ast.parse(init.read_text()).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id in ("_EXPORTS", "_PARTS") and isinstance(node.value, ast.Dict):
            for key, value in zip(node.value.keys, node.value.values):
                module = ast.literal_eval(value)
                out[ast.literal_eval(key)] = module if "." in module else f"{package}.{module}"
    return out


def _imports(path: Path, name: str, is_package: bool) -> list[tuple[str, str | None]]:
    """Every import in a file, wherever it stands (top level, ``if TYPE_CHECKING:``, a function's
    body): ``(module, name)`` pairs, relative imports resolved, ``name`` None for ``import m``."""
    base = name.split(".") if is_package else name.split(".")[:-1]
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend((a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                module = ".".join(base[: len(base) - node.level + 1] + ([module] if module else []))
            out.extend((module, a.name) for a in node.names)
    return out


def import_graph(files: dict[str, Path], lazy: dict[str, dict[str, str]], is_package: set[str],
                 leaves: frozenset[str] = frozenset()) -> dict[str, set[str]]:
    """Module -> the modules of ``files`` (and ``leaves``, modules that import nothing of ours: a C
    extension) it imports. ``from p import n`` points at ``p.n`` when that is a module, at the module
    a lazy package takes ``n`` from, else at ``p``; ``import a.b`` at ``a.b``."""
    known = set(files) | leaves
    graph: dict[str, set[str]] = {leaf: set() for leaf in leaves}
    for name, path in files.items():
        edges = set()
        for module, attr in _imports(path, name, name in is_package):
            if attr is not None and f"{module}.{attr}" in known:
                target = f"{module}.{attr}"
            elif attr is not None and attr in lazy.get(module, {}):
                target = lazy[module][attr]
            else:
                target = module
            if target in known and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan), each written
    as a path ``a -> b -> ... -> a`` through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle_through(graph, set(c), c[0]) for c in components]


def _circle_through(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest path from ``start`` back to itself inside its component (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in no circle")


def _package_graph() -> dict[str, set[str]]:
    files = {_module_name(f, ROOT): f for f in sorted(PACKAGE.rglob("*.py"))}
    # a C extension (`asyncrl.queue._fastgroups`) is a module that imports nothing of ours
    extensions = {_module_name(f, ROOT): f for f in sorted(PACKAGE.rglob("*.c"))}
    packages = {n for n, f in files.items() if f.name == "__init__.py"}
    lazy = {n: _lazy_exports(files[n], n) for n in packages}
    return import_graph(files, lazy, packages, frozenset(extensions))


def test_cycle_finder_reports_a_circle_and_only_a_circle(tmp_path):
    """The checker itself: a circle hidden behind a lazy export and an indirection is found, a
    diamond is not a circle."""
    graph = {"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}
    assert find_cycles(graph) == []
    graph["d"] = {"a"}
    assert find_cycles(graph) in ([["a", "b", "d", "a"]], [["a", "c", "d", "a"]])
    sources = {"p": '_EXPORTS = {"Y": "p.y"}\n', "p.x": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import Y\n",
               "p.y": "def f():\n    from . import x\n"}
    files = {n: tmp_path / f"{n}.py" for n in sources}
    for n, f in files.items():
        f.write_text(sources[n])
    graph = import_graph(files, {"p": _lazy_exports(files["p"], "p")}, {"p"})
    assert graph == {"p": set(), "p.x": {"p.y"}, "p.y": {"p.x"}}
    assert find_cycles(graph) == [["p.x", "p.y", "p.x"]]


def test_the_package_imports_in_no_circle():
    """`asyncrl/` as a graph of modules, every import counted (``TYPE_CHECKING`` blocks and imports
    inside functions too): no module reaches itself. A circle is a seam cut in the wrong place; a
    narrow interface (a Protocol, a record) in the lower module breaks it."""
    graph = _package_graph()
    assert len(graph) >= 120 and sum(len(e) for e in graph.values()) >= 250  # the graph is the package's
    assert [" -> ".join(c) for c in find_cycles(graph)] == []


_ROOM_ARROWS_BEING_MOVED: set[tuple[str, str]] = set()  # none left: no arrow between rooms may close a circle


def test_the_rooms_import_in_no_circle():
    """The rooms (`asyncrl`'s packages and top-level modules) as a graph: an arrow from a room to
    another for every import between their modules. No circle: a demo builder that needs the
    agent loop, the tasks and the engines (`asyncrl.demos`) sits above them, not inside `models`."""
    room = lambda module: ".".join(module.split(".")[:2])  # noqa: E731
    rooms: dict[str, set[str]] = {}
    for a, targets in _package_graph().items():
        rooms.setdefault(room(a), set()).update(
            room(b) for b in targets if room(b) != room(a) and (a, b) not in _ROOM_ARROWS_BEING_MOVED)
    assert {"asyncrl.agent", "asyncrl.models", "asyncrl.demos", "asyncrl.rollouter"} <= set(rooms)
    assert [" -> ".join(c) for c in find_cycles(rooms)] == []


def test_the_scripts_import_each_other_in_no_circle():
    """A script may import a sibling script's workload (it puts ``scripts/`` on the path), but not in
    a circle."""
    files = {f.stem: f for f in sorted(SCRIPTS.glob("*.py"))}
    graph = import_graph(files, {}, set())
    assert len(files) >= 20
    assert [" -> ".join(c) for c in find_cycles(graph)] == []


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


# The one function allowed past 60 lines: the loss, whose commented math reads best in one piece.
_LONG_ON_PURPOSE = {"trainer/algorithm.py:policy_loss"}


def test_no_module_or_function_of_the_package_outgrows_its_size():
    """STYLE.md, over all of `asyncrl/`: around 400 lines a module is a sign to split, a function
    over 60 hides two."""
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) >= 150
    too_long = {}
    for f in files:
        src = f.read_text()
        if len(src.splitlines()) > 400:
            too_long[str(f.relative_to(PACKAGE))] = len(src.splitlines())
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                too_long[f"{f.relative_to(PACKAGE)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert set(too_long) - _LONG_ON_PURPOSE == set(), too_long
    assert _LONG_ON_PURPOSE <= set(too_long)  # drop the exception when it no longer applies


def test_the_call_layer_is_split_by_concern_and_shares_the_streams_pump():
    """`asyncrl.rpc` is a package of small modules (STYLE.md sizes), and one socket pump
    (`asyncrl.pump`) drives both the calls' sockets and the sample stream's."""
    files = sorted((PACKAGE / "rpc").glob("*.py")) + [PACKAGE / "pump.py"]
    assert {f.stem for f in files} >= {"server", "client", "auth", "liveness", "wire", "pump"}
    # their sizes: test_no_module_or_function_of_the_package_outgrows_its_size
    assert not (PACKAGE / "rpc.py").exists()
    for user in ("rpc/server.py", "rpc/client.py", "queue/transport.py"):
        assert "asyncrl.pump" in imported_modules(PACKAGE / user), user
    assert not any("pickle" in m for f in files for m in imported_modules(f))  # no pickle on the calls' wire
