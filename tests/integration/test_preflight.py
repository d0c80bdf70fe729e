"""Everything is checked before Ray starts: exit 2, one line on stderr naming the problem, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]

# The launcher with Ray made unreachable: a check that passed would reach `placement.connect`
# and exit 99 instead of 2.
PROBE = ("import sys, asyncrl.placement as p\n"
         "p.connect = lambda *a, **k: sys.exit(99)\n"
         "from asyncrl.launch import main\n"
         "sys.exit(main(sys.argv[1:]))\n")


@dataclass
class Outcome:
    returncode: int
    stderr: str


@pytest.fixture
def launch(monkeypatch, capsys):
    """The launcher in this process (fast), Ray made unreachable the same way as PROBE."""
    import asyncrl.placement
    from asyncrl.launch import main

    def unreachable(*a, **k):
        raise AssertionError("the launcher reached Ray: a check did not stop it")

    monkeypatch.setattr(asyncrl.placement, "connect", unreachable)

    def run(*args: str) -> Outcome:
        capsys.readouterr()
        try:
            rc = main(list(args))
        except SystemExit as e:  # argparse's own errors
            rc = e.code
        return Outcome(rc, capsys.readouterr().err)

    return run


def assert_usage_error(out, *fragments: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("asyncrl: error: "), out.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_a_real_process_exits_2_with_one_line_and_no_traceback(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text(json.dumps({"prompt": "a"}) + "\n" + "{oops\n")
    out = subprocess.run([sys.executable, "-c", PROBE, "--dataset", str(bad), "--reward",
                          "asyncrl.tasks.arithmetic:reward"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert_usage_error(out, f"{bad}:2: not valid JSON")
    assert "Traceback" not in out.stderr


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("m") / "model"))


def test_unknown_and_ill_typed_keys_by_dotted_path(launch):
    assert_usage_error(launch("trainer.optim.lrr=1e-6"), "unknown key trainer.optim.lrr")
    assert_usage_error(launch("--steps", "many"), "steps (--steps)", "'many'")
    assert_usage_error(launch("--no-such-flag"), "--no-such-flag")


def test_model_path_that_is_not_a_model_dir(tmp_path, launch):
    assert_usage_error(launch("--model", str(tmp_path / "absent")), f"{tmp_path / 'absent'}: no such directory")
    assert_usage_error(launch("--model", str(tmp_path)), f"{tmp_path}: not a model directory")


def test_bad_rows_by_file_and_row(tmp_path, model, launch):
    bad = tmp_path / "train.jsonl"
    bad.write_text(json.dumps({"prompt": "a"}) + "\n\n" + json.dumps({"prompt": {"x": 1}}) + "\n")
    assert_usage_error(launch("--model", model, "--dataset", str(bad), "--reward", "asyncrl.tasks.arithmetic:reward"),
                       f"{bad}:3: needs a 'prompt'")
    parquet = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "x"}]), parquet)
    assert_usage_error(launch("--model", model, "data.val=" + str(parquet), "--reward", "asyncrl.tasks.arithmetic:reward"),
                       f"{parquet}: no 'prompt' column")
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}) + "\n")
    assert_usage_error(launch("--model", model, "--dataset", str(chat), "--reward", "asyncrl.tasks.arithmetic:reward"),
                       f"{chat}:1: prompt is chat messages but the model's tokenizer has no chat template")
    assert_usage_error(launch("--dataset", str(chat), "--reward", "asyncrl.tasks.arithmetic:reward"),
                       f"{chat}: chat-message prompts need a model with a chat template")


def test_rewards_checked_before_ray(tmp_path, launch):
    ok = tmp_path / "train.jsonl"
    ok.write_text(json.dumps({"prompt": "1+2="}) + "\n")
    assert_usage_error(launch("--dataset", str(ok), "--reward", "no_such_pkg_xyz.rewards:score"),
                       "data.reward='no_such_pkg_xyz.rewards:score': module 'no_such_pkg_xyz.rewards' does not import")
    assert_usage_error(launch("--dataset", str(ok), "--reward", "asyncrl.tasks.arithmetic:missing"),
                       "has no callable 'missing'")
    assert_usage_error(launch("--dataset", str(ok)), "data.train (--dataset)", "data.reward (--reward)")


def test_inconsistent_settings_name_both(launch):
    assert_usage_error(launch("rollout.groups_per_sync=5"), "rollout.groups_per_sync=5", "trainer.groups_per_batch")
    assert_usage_error(launch("--rollouter-gpus", "2"), "--rollouter-gpus", "--trainer-gpus")


def test_lora_settings_checked_before_ray(model, launch):
    assert_usage_error(launch("--model", model, "trainer.lora.rank=8", "trainer.lora.target_modules=[q_proj,qkv]"),
                       "trainer.lora.target_modules: 'qkv' is not a linear layer", "'down_proj'")
    assert_usage_error(launch("trainer.lora.rank=-1"), "trainer.lora.rank must be >= 0")


def test_print_config_is_the_resolved_yaml(tmp_path, capsys):
    from asyncrl.launch import main

    assert main(["--print-config", "--n", "4", "trainer.optim.lr=3e-4"]) == 0
    path = tmp_path / "c.yaml"
    path.write_text(capsys.readouterr().out)
    from asyncrl.config import load_config

    cfg, _ = load_config([str(path)], [])
    assert cfg.rollout.n == 4 and cfg.trainer.optim.lr == 3e-4 and "${" not in path.read_text()
