"""The config package's shape: small modules, small functions, and a flag table the launcher can
import without loading any section."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "asyncrl" / "config"


def test_no_module_or_function_of_the_config_outgrows_its_size():
    files = sorted(CONFIG.glob("*.py"))
    assert len(files) >= 10  # one module per section, the root, the loader, presets, flags
    too_long = {}
    for f in files:
        src = f.read_text()
        if len(src.splitlines()) > 400:
            too_long[f.name] = len(src.splitlines())
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                too_long[f"{f.name}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert too_long == {}


def test_the_launcher_reads_its_flags_from_the_config_without_loading_a_section():
    code = ("import sys, asyncrl.launch as L; from asyncrl.config import flags; "
            "assert L.FLAGS is flags.FLAGS; "
            "print(sorted(m for m in ('omegaconf', 'torch', 'zmq', 'asyncrl.config.root') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_presets_carry_no_figures():
    """Measurements and run diaries belong in docs/: a preset's docstring names the doc instead."""
    src = (CONFIG / "presets.py").read_text()
    docs = [n.value.value for n in ast.walk(ast.parse(src))
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)]
    assert len(docs) >= 9
    for marker in ("measured", "Measured", " x faster", "UTC", "reward 0.", "+0.", "seconds"):
        assert not any(marker in d for d in docs), marker
