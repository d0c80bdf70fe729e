"""What the installation built: the group codec's optional C accelerator."""

from __future__ import annotations

import os

import pytest


def test_the_codec_accelerator_is_built_where_ci_runs():
    # The extension is optional (no compiler: the codec runs pure Python), so a failed build
    # would not fail the install. CI has a compiler: there it must have been built, or the
    # suite would quietly test one of the codec's two paths.
    if not os.environ.get("CI"):
        pytest.skip("outside CI the accelerator is optional")
    if os.environ.get("ASYNCRL_PURE_PYTHON"):
        pytest.skip("ASYNCRL_PURE_PYTHON turns the accelerator off")
    import asyncrl.queue._fastgroups  # noqa: F401  (ImportError: it was not built)
    from asyncrl.queue import group_codec as codec

    assert codec._fast is not None


def test_a_wheel_ships_the_default_model(tmp_path):
    # The demo's starting policy is package data: a wheel (what a non-editable install
    # unpacks) must carry every file of it, byte for byte.
    import shutil
    import subprocess
    import sys
    import zipfile
    from pathlib import Path

    from asyncrl.models import DEFAULT_MODEL_DIR

    root = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(root / name, src / name)
    shutil.copytree(root / "asyncrl", src / "asyncrl", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("asyncrl-*.whl")
    shipped = sorted(p.name for p in DEFAULT_MODEL_DIR.iterdir() if p.is_file())
    assert "model.safetensors" in shipped and "warm_start.json" in shipped
    with zipfile.ZipFile(wheel) as zf:
        for name in shipped:
            assert zf.read(f"asyncrl/models/tiny_arith/{name}") == (DEFAULT_MODEL_DIR / name).read_bytes(), name


def test_the_cluster_extra_brings_rays_job_server_and_the_readme_says_so_at_the_command():
    import re
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    rays = [Requirement(r) for r in extras["cluster"] if Requirement(r).name == "ray"]
    assert rays and "default" in rays[0].extras, extras["cluster"]
    # Where the README shows `ray job submit`, the install line before it names the extra.
    readme = (root / "README.md").read_text()
    before = readme[:readme.index("ray job submit --address")]
    install = before[before.rindex("```bash"):]
    assert re.search(r"pip install -e '\.\[[^\]]*\bcluster\b[^\]]*\]'", install), install
