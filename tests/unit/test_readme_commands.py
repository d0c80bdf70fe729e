"""Every command the README prints runs as printed.

The fenced blocks marked ``<!-- runnable -->`` and the command column of the figures table are
parsed. Short commands run (``--help``, ``--help-config``); every launcher command is resolved
with ``--print-config`` in place of running it (flags, dotted keys and values checked, nothing
started); scripts must accept every flag they are given; pip extras must exist in pyproject.toml;
other modules must import.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def runnable_blocks(markdown: str) -> list[str]:
    return re.findall(r"^<!-- runnable -->\n```bash\n(.*?)^```$", markdown, re.M | re.S)


def commands(block: str) -> list[list[str]]:
    """Shell lines (continuations joined, comments dropped), split at ``&&``, as words."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1:]
    return out


def table_commands(markdown: str) -> list[list[str]]:
    """The figures table's command column: `python ...` cells, placeholders (``S``) filled in."""
    cells = re.findall(r"\| `(python [^`]+)` \|", markdown)
    return [[("0" if w == "S" else w) for w in shlex.split(c)] for c in cells]


def all_commands() -> list[list[str]]:
    cmds = [c for b in runnable_blocks(README) for c in commands(b)] + table_commands(README)
    # `ray job submit ... -- python -m asyncrl.launch ...`: what runs is after the `--`.
    return [c[c.index("--") + 1:] if c[:3] == ["ray", "job", "submit"] else c for c in cmds]


def script_flags(path: Path, seen: set[Path] | None = None) -> set[str]:
    """Every ``--flag`` string a script's source names (its argparse options), and those of the
    sibling scripts it imports (which may add their own options)."""
    seen = (seen or set()) | {path}
    tree = ast.parse(path.read_text())
    flags = {n.value for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"--[\w-]+", n.value)}
    imported = {a.name.split(".")[-1] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names} | {n.module.split(".")[-1] for n in ast.walk(tree)
                                     if isinstance(n, ast.ImportFrom) and n.module}
    for name in imported:
        sibling = path.parent / f"{name}.py"
        if sibling.is_file() and sibling not in seen:
            flags |= script_flags(sibling, seen)
    return flags


def test_the_readme_marks_its_commands():
    cmds = all_commands()
    launches = [c for c in cmds if c[:3] == ["python", "-m", "asyncrl.launch"]]
    assert len(runnable_blocks(README)) >= 5 and len(launches) >= 8, cmds
    # The quickstart's two commands, as CI's .ci/run runs the second one verbatim.
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = next(b for b in runnable_blocks(README) if "pytest" in b).strip()
    assert test_cmd in ci


def test_pip_extras_and_modules_exist():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for cmd in all_commands():
        if cmd[:2] == ["pip", "install"]:
            for word in cmd[2:]:
                m = re.fullmatch(r"\.\[([\w,-]+)\]", word)
                if m:
                    assert set(m.group(1).split(",")) <= extras, (cmd, extras)
        elif cmd[:2] == ["pip", "uninstall"]:
            assert "-y" in cmd
        elif cmd[0] == "ray":
            assert cmd[1] in {"start", "job"} and importlib.util.find_spec("ray"), cmd
        elif cmd[:2] == ["python", "-m"]:
            assert importlib.util.find_spec(cmd[2]) is not None, f"no module {cmd[2]}: {shlex.join(cmd)}"
        else:
            assert cmd[0] == "python" and cmd[1].startswith("scripts/"), f"unchecked command: {shlex.join(cmd)}"


def test_scripts_take_the_flags_they_are_given():
    for cmd in all_commands():
        if cmd[0] == "python" and cmd[1].startswith("scripts/"):
            script = ROOT / cmd[1]
            assert script.is_file(), cmd
            unknown = {w for w in cmd[2:] if w.startswith("--")} - script_flags(script)
            assert not unknown, f"{cmd[1]} has no {sorted(unknown)}"


_RUN_ALL = """
import contextlib, io, json, sys
from asyncrl.launch import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    except SystemExit as e:
        rc = e.code
    results.append([argv, rc, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def test_launcher_commands_run_or_resolve(tmp_path):
    """--help and --help-config run; every other launcher command resolves its config (its YAML
    from the README when it names run.yaml), exit 0, with what it asked for in the result."""
    yaml = re.search(r"^```yaml\n(.*?)^```$", README, re.M | re.S)
    (tmp_path / "run.yaml").write_text(yaml.group(1) if yaml else "")
    argvs = []
    for cmd in all_commands():
        if cmd[:3] != ["python", "-m", "asyncrl.launch"]:
            continue
        args = [a for a in cmd[3:] if a != "--dry-run"]
        short = "--help" in args or "--help-config" in args
        argvs.append(args if short else args + ["--print-config"])
    assert argvs
    argvs.append(["--help-config", "no_such_section"])  # the check can fail
    done = subprocess.run([sys.executable, "-c", _RUN_ALL, json.dumps(argvs)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    *printed, (_, bad_rc, _, bad_err) = results
    assert bad_rc == 2 and "no config section" in bad_err
    for argv, rc, out, err in printed:
        assert rc in (0, None), f"python -m asyncrl.launch {shlex.join(argv)} exited {rc}: {err[-2000:]}"
        if "--help" in argv:
            assert "--help-config" in out
        elif "--help-config" in argv:
            section = argv[argv.index("--help-config") + 1]
            assert f"[{section}]" in out and f"{section}." in out
        else:
            assert "\nsteps: " in "\n" + out, out[:500]
            for word in argv:
                if re.fullmatch(r"[\w.]+=[^=]+", word):
                    key, value = word.split("=", 1)
                    leaf = key.rsplit(".", 1)[-1]
                    assert re.search(rf"^\s*'?{leaf}'?: {re.escape(value)}\s*$", out, re.M), (word, argv)
