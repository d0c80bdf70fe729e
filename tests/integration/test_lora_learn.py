"""LoRA through ``python -m asyncrl.launch --mode sync``: the engines sample from exactly the
weights the trainer holds (``is_ratio`` within 1e-3 of 1 on every step), on the built-in engine
(with a resume from an adapters-only checkpoint) and on vLLM's CPU build."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from learn_sync import learn

ROOT = Path(__file__).resolve().parents[2]
LORA = ["trainer.lora.rank=4", "trainer.lora.alpha=32"]
LR = 1e-2  # large for the demo: the adapters move far enough in a step that a stale engine would show


def assert_exact(history: list[dict], steps: range) -> None:
    assert [m["step"] for m in history] == list(steps)
    assert [m["version"] for m in history] == list(steps)  # a sync after every step
    for m in history:
        assert abs(m["is_ratio_min"] - 1) < 1e-3 and abs(m["is_ratio_max"] - 1) < 1e-3, m
        assert m["grad_norm"] > 0


def checkpoint_keys(run_dir: Path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    return [k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("model.")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lora_sync_mode_is_exact_on_the_builtin_engine_and_after_a_resume(tmp_path):
    run_dir = tmp_path / "run"
    history = learn("sync", 3, 8, 8, LR, 0, run_dir, extra=[*LORA, "trainer.checkpoint_every=1"])
    assert_exact(history, range(1, 4))
    keys = checkpoint_keys(run_dir)  # adapters only: the frozen base is the model directory's
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys), keys[:5]
    # resumed: the engines start from the base model and get the checkpoint's adapters first
    out = subprocess.run([sys.executable, "-m", "asyncrl.launch", "--resume", str(run_dir), "--steps", "5"],
                         cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    resumed = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert_exact(resumed, range(1, 6))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lora_sync_mode_is_exact_on_vllm(tmp_path):
    pytest.importorskip("vllm")
    # with the norms trained in full: they reach vLLM's worker beside the merged adapters
    history = learn("sync", 3, 8, 8, LR, 0, tmp_path / "run",
                    extra=[*LORA, "trainer.lora.train_norms=true", "engine.kind=vllm"])
    assert_exact(history, range(1, 4))
