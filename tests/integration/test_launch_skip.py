"""``python -m asyncrl.launch skip.async_rollout.enable=true ...``: a second run with the same skip config generates
nothing for the listed steps (the Trainer trains on replayed groups only, the engines serve
no request for them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from asyncrl.models.tiny import build_tiny_model

N, GROUPS_PER_STEP, STEPS = 4, 3, 2


def launch(run_launch, model: Path, run_dir: Path, dumps: Path) -> tuple[list[dict], dict]:
    # staleness 0 and a sync every step: step s trains exactly on feed indices 3s..3s+2.
    out = run_launch("--model", model, "--steps", STEPS, "--n", N, "--groups-per-step", GROUPS_PER_STEP,
                     "--sync-every", "1", "--staleness-threshold", "0", "--max-tokens", "4", "--lr", "1e-3",
                     "--run-dir", run_dir, "skip.experiment=e2e", "skip.async_rollout.enable=true",
                     f"skip.async_rollout.dump_dir={dumps}", "skip.async_rollout.steps=[0,1,2,3,4,5]")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    m = re.search(r"rollouter admitted (\d+) groups, sent (\d+), replayed (\d+) from skip dumps; "
                  r"engines served (\d+) requests(?:; skip.async_rollout (\{.*\}))?", out)
    assert m, out[-3000:]
    admitted, sent, replayed, requests = map(int, m.groups()[:4])
    return rows, {"admitted": admitted, "replayed": replayed, "requests": requests,
                  "skip": json.loads(m.group(5) or "{}")}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_second_launch_replays_the_listed_steps(tmp_path, run_launch):
    model = build_tiny_model(tmp_path / "model")
    dumps = tmp_path / "dumps"
    rows, first = launch(run_launch, model, tmp_path / "run1", dumps)
    assert [r["replayed_groups"] for r in rows] == [0, 0]
    assert first["replayed"] == 0 and first["skip"]["dumped"] == 6  # every listed step generated and dumped
    assert first["requests"] >= 6 * N
    listed = sorted(p.parent.name for p in dumps.rglob("meta.json"))
    assert listed == [f"step_{i}" for i in range(6)]

    rows, second = launch(run_launch, model, tmp_path / "run2", dumps)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["replayed_groups"] for r in rows] == [GROUPS_PER_STEP, GROUPS_PER_STEP]  # trained on dumps only
    assert second["skip"] == {"replayed": 6}  # no listed step generated or dumped again
    # Only unlisted samples (feed index >= 6, admitted after the last sync) reached the engines.
    assert second["requests"] <= (second["admitted"] - 6) * N
