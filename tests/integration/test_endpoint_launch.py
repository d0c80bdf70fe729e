"""``python -m asyncrl.launch --mode sync`` with ``rollout.agent.function``: an OpenAI-client agent
(three calls per episode, each answer echoed back) trained through its endpoint in the Rollouter
actor (Ray, the built-in engine, a tiny random chat model, a chat-message dataset). Tokens are
exact end to end, so on-policy the trainer's ``is_ratio`` is within 1e-3 of 1 on every step. Every
other episode then replaces its history with a summary (a second branch): both branches are trained."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.launching import ROOT

AGENT = '''
import openai

async def three_calls(row, client):
    c = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
    msgs = list(row["prompt"])  # the dataset's chat messages, as written
    for k in range(3):
        r = await c.chat.completions.create(model=client.model, messages=msgs, max_tokens=6)
        msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"go on {k}"}]
    if int(client.base_url.split("/s/")[1].split("-")[1]) % 2 == 0:  # episode k of {sample_id}-{k}-{hex}: a summary
        summary = [{"role": "user", "content": "so far: " + (r.choices[0].message.content or "")}]
        await c.chat.completions.create(model=client.model, messages=summary, max_tokens=6)
    return float(len(r.choices[0].message.content or "") % 2)


def unused(prompt, response):
    raise AssertionError("the agent returns every reward")
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sync_mode_trains_a_function_agent_with_exact_tokens(tmp_path):
    from asyncrl.models.tiny_chat import build_chat_model

    model = build_chat_model(tmp_path / "model")
    (tmp_path / "ep_agent.py").write_text(AGENT)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}]}) + "\n" for i in range(8)))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "asyncrl.launch", "--mode", "sync", "--steps", "2", "--groups-per-step", "2", "--n", "4",
           "--model", str(model), "--dataset", str(data), "--reward", "ep_agent:unused", "--run-dir", str(run_dir),
           "rollout.agent.function=ep_agent:three_calls", "rollout.agent.max_turns=4",
           "rollout.agent.max_tokens_per_turn=6", "rollout.agent.max_context_tokens=512"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        # per group: episodes 0 and 2 as their summary (1 turn) and their first branch (3), episodes 1 and 3 (3)
        assert m["agent/turns_mean"] == pytest.approx(14 / 6) and m["staleness_max"] == 0
        assert m["is_ratio_max"] == pytest.approx(1.0, abs=1e-3) and m["is_ratio_min"] == pytest.approx(1.0, abs=1e-3)
    trained = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(trained) == 4 and all(s["turns"] == [1, 3, 3, 1, 3, 3] for s in trained)
    forks = [json.loads(line) for line in (run_dir / "endpoint_forks.jsonl").read_text().splitlines()]
    assert len(forks) >= 8 and all(f["message_index"] == 0 for f in forks)  # the summary differs at its first message
