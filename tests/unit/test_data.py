"""`asyncrl.data`: verl-layout rows from JSONL and parquet, chat rendering, rewards of both signatures."""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl import data
from asyncrl.data import DataError
from asyncrl.models.tiny import build_tokenizer
from asyncrl.rollouter.worker import DataSpec, load_prompts, make_reward_fn

VERL_ROWS = [
    {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}],
     "data_source": "toy", "reward_model": {"style": "rule", "ground_truth": "3"}, "extra_info": {"split": "train"}},
    {"prompt": "4+4=", "data_source": "toy", "reward_model": {"ground_truth": "8"}},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_give_the_same_rows(tmp_path):
    jsonl = data.read_rows(write_jsonl(tmp_path / "d.jsonl", VERL_ROWS))
    assert [r.ground_truth for r in jsonl] == ["3", "8"]
    assert jsonl[0].prompt[1] == {"role": "user", "content": "1+2="}
    assert jsonl[0].data_source == "toy" and jsonl[0].extra_info == {"split": "train"}
    assert jsonl[1].prompt == "4+4=" and jsonl[1].extra_info == {}
    # A parquet column has one type: verl's files hold chat messages in every row.
    chat = [dict(r, prompt=[{"role": "user", "content": "4+4="}]) if isinstance(r["prompt"], str) else r
            for r in VERL_ROWS]
    pq.write_table(pa.Table.from_pylist(chat), tmp_path / "d.parquet")
    rows = data.read_rows(tmp_path / "d.parquet")
    assert [r.ground_truth for r in rows] == ["3", "8"]
    assert rows[0].prompt == VERL_ROWS[0]["prompt"] and rows[1].prompt == [{"role": "user", "content": "4+4="}]
    assert rows[0].data_source == "toy" and rows[0].extra_info == {"split": "train"}
    assert rows[1].extra_info == {}


@pytest.mark.parametrize("line, expected", [
    ('{"prompt": 3}', "d.jsonl:2: needs a 'prompt'"),
    ('{"text": "hi"}', "d.jsonl:2: needs a 'prompt'"),
    ('{"prompt": [{"role": "user"}]}', "d.jsonl:2: prompt message 0"),
    ('{"prompt": "x", "reward_model": "3"}', "d.jsonl:2: 'reward_model' must be an object"),
    ('{"prompt": "x", "extra_info": [1]}', "d.jsonl:2: 'extra_info' must be an object"),
    ('{"prompt": "x"', "d.jsonl:2: not valid JSON"),
    ('[1, 2]', "d.jsonl:2: a row must be an object"),
])
def test_a_bad_row_is_named_by_file_and_line(tmp_path, line, expected):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(DataError) as e:
        data.read_rows(path)
    assert expected in str(e.value)


def test_parquet_without_prompt_and_unknown_formats(tmp_path):
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "x"}]), parquet)
    with pytest.raises(DataError, match="no 'prompt' column"):
        data.read_rows(parquet)
    (tmp_path / "d.csv").write_text("prompt\nx\n")
    with pytest.raises(DataError, match="unknown dataset format"):
        data.read_rows(tmp_path / "d.csv")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="junk.parquet: not a readable parquet"):
        data.read_rows(tmp_path / "junk.parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no rows"):
        data.read_rows(tmp_path / "empty.jsonl")


def test_chat_prompts_render_with_the_chat_template(tmp_path):
    tok = build_tokenizer()
    rows = data.read_rows(write_jsonl(tmp_path / "d.jsonl", VERL_ROWS))
    with pytest.raises(DataError, match="d.jsonl:1: prompt is chat messages but the model's tokenizer has no chat"):
        data.check_renderable(tok, rows, str(tmp_path / "d.jsonl"))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }};{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    data.check_renderable(tok, rows, "d.jsonl")
    text, ids = data.prompt_text_and_ids(tok, rows[0])
    assert text == "be brief;1+2=;>"
    assert ids.dtype == np.int64 and tok.decode(ids) == text
    text, ids = data.prompt_text_and_ids(tok, rows[1])
    assert text == "4+4=" and list(ids) == tok("4+4=")["input_ids"]


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        calls = []

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            calls.append((data_source, solution_str, ground_truth, extra_info))
            return 1.0 if solution_str.strip() == ground_truth else 0.0

        async def async_score(data_source, solution_str, ground_truth, extra_info):
            return {"score": 0.5, "acc": True}

        def short(prompt, response):
            return float(len(response))

        async def short_async(prompt, response):
            return 2.0

        def three(a, b, c):
            return 0.0

        not_callable = 3

        def bad_dict(prompt, response):
            return {"acc": 1}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_rewards_of_both_signatures_sync_and_async(reward_module):
    meta = {"data_source": "toy", "ground_truth": "3", "extra_info": {"k": 1}}
    verl = data.load_reward(f"{reward_module}:compute_score")
    assert verl.verl_style
    assert asyncio.run(verl("1+2=", meta, " 3")) == 1.0
    assert sys.modules[reward_module].calls == [("toy", " 3", "3", {"k": 1})]
    assert asyncio.run(data.load_reward(f"{reward_module}:async_score")("p", meta, "r")) == 0.5
    short = data.load_reward(f"{reward_module}:short")
    assert not short.verl_style and asyncio.run(short("p", meta, "abcd")) == 4.0
    assert asyncio.run(data.load_reward(f"{reward_module}:short_async")("p", meta, "r")) == 2.0
    with pytest.raises(DataError, match="without 'score'"):
        asyncio.run(data.load_reward(f"{reward_module}:bad_dict")("p", meta, "r"))
    assert short.score("p", meta, "abc") == 3.0 and not short.is_async
    assert data.load_reward(f"{reward_module}:short_async").is_async
    with pytest.raises(DataError, match="without 'score'"):
        data.load_reward(f"{reward_module}:bad_dict").score("p", meta, "r")


async def test_a_slow_plain_reward_runs_off_the_rollouters_event_loop(tmp_path, monkeypatch):
    """`rollout.reward_workers` from the launcher's path: a plain reward that blocks 0.3 s per call
    runs on the reward threads (none on the event loop's), several at once, so the loop keeps turning."""
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.engines.sim import SimEngine
    from asyncrl.rollouter.rollouter import RolloutConfig, Rollouter

    # The reward notes, per call, whether it ran on the event loop's thread and how many calls ran then.
    (tmp_path / "slow_rewards.py").write_text(
        "import threading, time\n\ncalls, running, lock = [], [0], threading.Lock()\n\n"
        "def slow(prompt, response):\n    with lock:\n        running[0] += 1\n"
        "        calls.append((threading.current_thread() is threading.main_thread(), running[0]))\n"
        "    time.sleep(0.3)\n    with lock:\n        running[0] -= 1\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    tok = build_tokenizer()
    spec = DataSpec(seed=0, reward="slow_rewards:slow")
    prompts = load_prompts(tok, spec)[:8]
    engine = SimEngine(tokens_per_s=1e5, max_running=64, median_tokens=4, long_tail=1)
    sink = MemorySink()
    cfg = RolloutConfig(n=4, max_tokens=8, groups_per_sync=100, max_concurrent=8, reward_workers=8)
    r = Rollouter(cfg, [engine], sink, prompts, make_reward_fn(tok, spec))
    try:
        await asyncio.wait_for(r.run(num_groups=8), 60)
    finally:
        await engine.close()
    assert len(sink.groups) == 8 and all(t.reward == 1.0 for g in sink.groups for t in g.trajectories)
    # 32 rewards of 0.3 s: on the loop they would hold it 0.3 s at a time (9.6 s in all). None ran on
    # the loop's thread, and several at once (reward_workers=8): not one after another.
    import slow_rewards

    assert len(slow_rewards.calls) == 32 and not any(on_loop for on_loop, _ in slow_rewards.calls)
    assert max(running for _, running in slow_rewards.calls) >= 2


@pytest.mark.parametrize("spec, expected", [
    ("nocolon", "data.reward='nocolon': expected 'module:Name'"),
    ("no_such_module_xyz:f", "data.reward='no_such_module_xyz:f': module 'no_such_module_xyz' does not import "
                             "(ModuleNotFoundError"),
    ("{mod}:missing", "has no callable 'missing'"),
    ("{mod}:not_callable", "has no callable 'not_callable' (its value is of type int)"),
    ("{mod}:three", "takes (a, b, c)"),
])
def test_bad_rewards_are_named(reward_module, spec, expected):
    with pytest.raises(DataError) as e:
        data.load_reward(spec.format(mod=reward_module))
    assert expected in str(e.value)


def test_rollouter_prompts_carry_the_reward_meta_and_score_with_it(tmp_path, reward_module):
    tok = build_tokenizer()
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+2=", "data_source": "toy",
                                               "reward_model": {"ground_truth": "3"}}])
    spec = DataSpec(train=str(path), reward=f"{reward_module}:compute_score")
    prompts = load_prompts(tok, spec)
    assert prompts[0].meta == {"data_source": "toy", "ground_truth": "3", "extra_info": {}}
    reward_fn = make_reward_fn(tok, spec)
    # A plain reward gives a plain reward_fn: the Rollouter runs it, decode and all, on its reward threads.
    assert not inspect.iscoroutinefunction(reward_fn)
    right = np.asarray(tok("3", add_special_tokens=False)["input_ids"] + [tok.eos_token_id, 5], dtype=np.int64)
    wrong = np.asarray(tok("4", add_special_tokens=False)["input_ids"], dtype=np.int64)
    assert reward_fn(prompts[0], right) == 1.0  # decoded up to EOS
    assert reward_fn(prompts[0], wrong) == 0.0
    async_fn = make_reward_fn(tok, DataSpec(train=str(path), reward=f"{reward_module}:async_score"))
    assert inspect.iscoroutinefunction(async_fn) and asyncio.run(async_fn(prompts[0], wrong)) == 0.5


def test_builtin_task_prompts_and_reward():
    tok = build_tokenizer()
    spec = DataSpec(seed=3)
    prompts = load_prompts(tok, spec)
    assert len(prompts) == 4096 and prompts[0].meta["data_source"] == "asyncrl/arithmetic"
    answer = prompts[0].meta["ground_truth"]
    ids = np.asarray(tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id], dtype=np.int64)
    assert make_reward_fn(tok, spec)(prompts[0], ids) == 1.0


def test_model_dir_check_names_the_path(tmp_path):
    with pytest.raises(DataError, match="no such directory"):
        data.check_model_dir(str(tmp_path / "nope"))
    with pytest.raises(DataError, match="not a model directory"):
        data.check_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DataError, match="no weights"):
        data.check_model_dir(str(tmp_path))


async def test_validation_scores_each_prompt_greedily_with_ids_apart_from_training(tmp_path, reward_module):
    from asyncrl.rollouter.rollouter import RolloutConfig
    from asyncrl.rollouter.engines.builtin.engine import TorchEngine
    from asyncrl.rollouter.worker import RolloutWorker
    from asyncrl.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}])
    val = write_jsonl(tmp_path / "v.jsonl", [{"prompt": f"{i}+1=", "data_source": "toy",
                                              "reward_model": {"ground_truth": str(i + 1)}} for i in range(3)])
    engine = TorchEngine(str(model))
    seen = []
    generate = engine.generate

    async def spy(request):
        seen.append((request.request_id, request.sampling.greedy))
        return await generate(request)

    engine.generate = spy
    spec = DataSpec(train=str(train), val=str(val), reward=f"{reward_module}:compute_score")
    worker = RolloutWorker(RolloutConfig(n=2, max_tokens=3), [engine], stream=None, model_path=str(model),
                           data_spec=spec)
    try:
        metrics = await worker.validate(step=7)
    finally:
        await engine.close()
    assert sorted(seen) == [("val_7_0", True), ("val_7_1", True), ("val_7_2", True)]
    assert metrics["val/samples"] == 3.0 and 0.0 <= metrics["val/reward_mean"] <= 1.0
    calls = sys.modules[reward_module].calls
    assert sorted(c[2] for c in calls) == ["1", "2", "3"] and {c[0] for c in calls} == {"toy"}
    assert metrics["val/reward_mean"] == pytest.approx(np.mean([c[1].strip() == c[2] for c in calls]))
    assert worker.feed_state()["next_index"] == 0  # validation never moves the training feed
