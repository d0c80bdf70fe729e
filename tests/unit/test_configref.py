"""The config reference: generated from the dataclasses, checked in, and printed by the launcher."""

import dataclasses
import subprocess
import sys
from pathlib import Path

from asyncrl import configref
from asyncrl.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]


def _leaf_paths(cls, prefix=""):
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            yield from _leaf_paths(sub, path)
        else:
            yield path


def test_docs_config_md_is_current():
    checked_in = (ROOT / "docs" / "config.md").read_text()
    assert checked_in == configref.markdown(), (
        "docs/config.md is stale: run `python -m asyncrl.configref > docs/config.md`")


def test_every_key_is_listed_once_with_a_docstring():
    keys = [k for s in configref.sections() for k in s.keys]
    assert sorted(k.path for k in keys) == sorted(_leaf_paths(RunConfig))
    undocumented = [k.path for k in keys if not k.doc]
    assert undocumented == [], f"config fields without a docstring: {undocumented}"


def test_defaults_and_docs_are_the_fields_own():
    by_path = {k.path: k for s in configref.sections() for k in s.keys}
    assert by_path["trainer.optim.lr"].default == repr(RunConfig().trainer.optim.lr)
    assert by_path["trainer.optim.lr"].doc == "Peak learning rate."
    assert by_path["steps"].type == "int" and by_path["steps"].default == "100"
    assert by_path["model.path"].default == "null"
    assert by_path["stream.window"].default.startswith("${")  # derived unless given
    assert "rollout.groups_per_sync" not in by_path  # the Trainer's, passed in: not a key


def test_help_config_prints_one_section_without_torch_or_ray():
    code = ("import sys; from asyncrl.launch import main; rc = main(['--help-config', 'trainer.optim']); "
            "print('HEAVY', sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules)); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "trainer.optim.lr: float = 1e-05" in out.stdout
    assert "trainer.algorithm" not in out.stdout and "rollout.n" not in out.stdout
    assert "HEAVY []" in out.stdout


def test_help_config_unknown_section_names_the_sections():
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch", "--help-config", "trainr"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2
    assert "no config section 'trainr'" in out.stderr and "trainer.optim" in out.stderr
