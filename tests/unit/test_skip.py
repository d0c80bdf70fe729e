"""SkipManager in-process: dumps (format, validity, keys, concurrent writers), the decorator's flow
for sync and async functions, cache and repeat, and the rollout roles on a real TorchEngine."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import numpy as np
import pytest
import torch

from asyncrl.skip import (REPLAY_KEY, DumpError, DumpKey, DumpStore, SkipAction, SkipConfig, SkipManager,
                          SkipRoleConfig, is_replayed)
from asyncrl.skip.config import load_skip_config
from asyncrl.types import Group, Trajectory
from asyncrl.queue.memory import MemorySink


@pytest.fixture(autouse=True)
def _fresh_manager():
    SkipManager.reset()
    yield
    SkipManager.reset()


def make_group(index: int, n: int = 3, seed: int = 0) -> Group:
    rng = np.random.default_rng(seed * 1000 + index)
    sid = f"sample_0_{index}"
    trajs = []
    for k in range(n):
        r = rng.integers(3, 40, size=5)
        trajs.append(Trajectory(sample_id=sid, index=k, prompt_ids=np.array([1, 2, index % 50 + 3]), response_ids=r,
                                logprobs=rng.uniform(-3, 0, size=5).astype(np.float32), versions=np.zeros(5, np.int64),
                                finish_reason="length", reward=float(k)))
    return Group(sample_id=sid, trajectories=trajs, expected=n, meta={"prompt": f"p{index}"})


def key(**shape) -> DumpKey:
    return DumpKey(experiment="exp", role="async_rollout", shape={"n": 3, **shape})


# ------------------------------------------------------------------------------------ store


def test_dump_round_trips_with_the_codec_and_is_valid_only_when_data_and_meta_agree(tmp_path):
    store = DumpStore(tmp_path, key())
    assert not store.valid(4)
    with pytest.raises(FileNotFoundError):
        store.load(4)
    g = make_group(4)
    data = store.write(4, g)
    assert store.load(4) == g
    meta = json.loads((store.step_dir(4) / "meta.json").read_text())
    assert meta["data_file"] == data.name and meta["data_bytes"] == data.stat().st_size
    assert b"pickle" not in data.read_bytes() and data.read_bytes()[:8] == b"ASRLDUMP"
    assert json.loads((store.dir / "shape.json").read_text()) == {"n": 3}

    # Same size, one flipped byte: the hash in meta.json no longer agrees.
    raw = bytearray(data.read_bytes())
    raw[-20] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert store.valid(4)  # the cheap check (size) passes ...
    with pytest.raises(DumpError, match="SHA-256"):
        store.load(4)  # ... the load does not
    data.write_bytes(bytes(raw[:-16]))
    assert not store.valid(4)
    data.unlink()
    assert not store.valid(4)
    store.write(4, g)
    (store.step_dir(4) / "meta.json").unlink()
    assert not store.valid(4)


def test_a_dump_of_another_experiment_or_shape_is_never_loaded(tmp_path, caplog):
    DumpStore(tmp_path, key()).write(2, make_group(2))
    assert DumpStore(tmp_path, key()).valid(2)
    other_exp = DumpStore(tmp_path, DumpKey(experiment="other", role="async_rollout", shape={"n": 3}))
    other_shape = DumpStore(tmp_path, key(max_tokens=8))
    assert not other_exp.valid(2) and not other_shape.valid(2)
    assert other_shape.foreign(2) == [f"{DumpStore(tmp_path, key()).step_dir(2)} has another shape "
                                      "(max_tokens: None -> 8)"]
    assert "is experiment 'exp', not 'other'" in other_exp.foreign(2)[0]

    # A step directory copied under another key is refused by its meta.json, with the reason.
    src, dst = DumpStore(tmp_path, key()).step_dir(2), other_shape.step_dir(2)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    with caplog.at_level(logging.WARNING, logger="asyncrl.skip"):
        assert not other_shape.valid(2)
    assert "another shape (max_tokens: None -> 8)" in caplog.text
    with pytest.raises(DumpError, match="another shape"):
        other_shape.load(2)


def test_two_writers_of_one_step_leave_one_valid_dump(tmp_path):
    store = DumpStore(tmp_path, key())
    values = [make_group(7, seed=s) for s in range(2)]
    errors = []

    def writer(v):
        try:
            for _ in range(15):
                DumpStore(tmp_path, key()).write(7, v)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(v,)) for v in values]
    for t in threads:
        t.start()
    seen = []
    while any(t.is_alive() for t in threads):
        try:  # a reader racing the writers sees a whole dump or none, never a broken one
            seen.append(store.load(7))
        except FileNotFoundError:
            pass
    for t in threads:
        t.join()
    assert not errors
    assert store.load(7) in values
    assert all(v in values for v in seen)
    assert len(list(store.step_dir(7).glob("data-*.bin"))) == 1  # superseded data files are removed
    assert not list(store.step_dir(7).glob("*.tmp"))


# ------------------------------------------------------------------------------------ config


def test_config_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "skip.yaml"
    path.write_text("skip:\n  experiment: e1\n  async_rollout:\n    enable: true\n    steps: [3, 1, 3]\n")
    cfg = load_skip_config(str(path), ["async_rollout.action=repeat", "skip.rollout.dump_dir=rel"])
    assert cfg.experiment == "e1"
    assert cfg.async_rollout.enable and cfg.async_rollout.steps == [1, 3]
    assert cfg.async_rollout.action == SkipAction.REPEAT == "repeat"
    assert cfg.rollout.dump_dir.endswith("/rel") and cfg.rollout.dump_dir.startswith("/")
    with pytest.raises(ValueError, match="nope"):
        load_skip_config(None, ["async_rollout.nope=1"])
    with pytest.raises(ValueError, match="integers >= 0"):
        SkipRoleConfig(steps=[-1])
    with pytest.raises(ValueError, match="empty list"):
        SkipRoleConfig(enable=True, steps=[])
    with pytest.raises(ValueError, match="file-name-safe"):
        SkipConfig(experiment="../x")


# ------------------------------------------------------------------------------------ decorator


def role_config(tmp_path, action="cache", steps=None) -> SkipConfig:
    return SkipConfig(experiment="exp", rollout=SkipRoleConfig(enable=True, dump_dir=str(tmp_path), steps=steps,
                                                               action=action))


class BatchMaker:
    """A ``rollout``-role function that counts its real calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, step_seed: int) -> list[Group]:
        self.calls.append(step_seed)
        return [make_group(2 * step_seed + i, seed=step_seed) for i in range(2)]


def test_cache_runs_and_dumps_listed_steps_then_replays_them(tmp_path):
    maker = BatchMaker()
    fn = SkipManager.annotate(role="rollout")(maker)
    SkipManager.init(role_config(tmp_path, steps=[0, 1]), shape={"n": 3})
    with pytest.raises(RuntimeError, match="set_step"):
        fn(0)
    first = {}
    for step in (0, 1, 2):
        SkipManager.set_step(step)
        first[step] = fn(step)
    assert maker.calls == [0, 1, 2]
    for step in (0, 1, 2):
        SkipManager.set_step(step)
        again = fn(step)
        if step == 2:  # not listed: runs every time, never dumped
            assert not any(map(is_replayed, again))
        else:
            assert again == [_marked_like(g, a) for g, a in zip(first[step], again)]
            assert [g.meta[REPLAY_KEY]["source_step"] for g in again] == [step, step]
    assert maker.calls == [0, 1, 2, 2]
    assert SkipManager.stats() == {"rollout": {"dumped": 2, "replayed": 2}}  # step 2 is not counted
    # A disabled role, or no init in this process, runs the function.
    SkipManager.init(SkipConfig())
    SkipManager.set_step(0)
    fn(0)
    assert maker.calls[-1] == 0 and len(maker.calls) == 5


def _marked_like(original: Group, replayed: Group) -> Group:
    """``original`` with the replay mark ``replayed`` carries (everything else must be equal)."""
    return Group(sample_id=original.sample_id, trajectories=original.trajectories, expected=original.expected,
                 status=original.status, error=original.error,
                 meta={**original.meta, REPLAY_KEY: replayed.meta[REPLAY_KEY]})


def test_repeat_uses_that_step_else_nearest_earlier_else_nearest_later_else_runs(tmp_path):
    maker = BatchMaker()
    fn = SkipManager.annotate(role="rollout")(maker)
    SkipManager.init(role_config(tmp_path, action="repeat"), shape={"n": 3})
    SkipManager.set_step(4)
    fn(4)  # nothing dumped yet: runs, dumps step 4
    assert maker.calls == [4]
    SkipManager.set_step(7)
    SkipManager.skip_instances["rollout"].store.write(7, maker(7))
    maker.calls.clear()

    def source(step):
        SkipManager.set_step(step)
        groups = fn(step)
        return groups[0].meta[REPLAY_KEY]["source_step"], [g.sample_id for g in groups]

    assert source(7) == (7, ["sample_0_14", "sample_0_15"])  # its own dump
    assert source(6) == (4, ["sample_0_12", "sample_0_13"])  # nearest earlier, relabelled to step 6's ids
    assert source(9) == (7, ["sample_0_18", "sample_0_19"])  # nearest earlier
    assert source(2) == (4, ["sample_0_4", "sample_0_5"])  # none earlier: nearest later
    # The nearest earlier dump is corrupt: the next candidate answers.
    data = next(SkipManager.skip_instances["rollout"].store.step_dir(7).glob("data-*.bin"))
    data.write_bytes(b"\0" * data.stat().st_size)
    assert source(8) == (4, ["sample_0_16", "sample_0_17"])
    assert maker.calls == []


def test_async_functions_and_a_named_step_argument(tmp_path):
    calls = []

    @SkipManager.annotate(role="async_rollout", step_arg="sid")
    async def make(sid: str, *, seed: int = 0) -> Group:
        calls.append(sid)
        await asyncio.sleep(0)
        return make_group(int(sid.rsplit("_", 1)[1]), seed=seed)

    SkipManager.init(SkipConfig(async_rollout=SkipRoleConfig(enable=True, dump_dir=str(tmp_path))), shape={})

    async def main():
        a = await make("sample_0_3", seed=1)
        b = await make("sample_0_3", seed=2)  # replayed: the seed of the dumped call wins
        return a, b

    a, b = asyncio.run(main())
    assert calls == ["sample_0_3"]
    assert b.trajectories == a.trajectories and is_replayed(b) and not is_replayed(a)


def test_an_enabled_role_nobody_registered_is_an_error(tmp_path):
    from dataclasses import dataclass, field

    @dataclass(kw_only=True)
    class Extended(SkipConfig):
        reward_model: SkipRoleConfig = field(default_factory=lambda: SkipRoleConfig(enable=True))

    with pytest.raises(ValueError, match="no skip module is registered for role 'reward_model'"):
        SkipManager.init(Extended())


# ------------------------------------------------------------------------------------ the rollout roles on a real engine


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from asyncrl.models.tiny import build_tiny_model

    torch.set_num_threads(1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))




def length_reward(text, response_ids):
    return float(len(response_ids))


async def run_rollouter(model_path, dump_dir, steps, num_groups, action="cache"):
    """One Rollouter run with ``async_rollout`` on ``steps``; returns (groups by id, engine requests)."""
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
    from asyncrl.rollouter.engines.builtin.engine import TorchEngine

    SkipManager.init(SkipConfig(experiment="t", async_rollout=SkipRoleConfig(
        enable=True, dump_dir=str(dump_dir), steps=steps, action=action)), shape={"model": str(model_path)})
    engine = TorchEngine(model_path, eos_token_ids=())
    prompts = [Prompt(text=f"p{i}", prompt_ids=np.array([1, 4 + i, 5], dtype=np.int64)) for i in range(5)]
    producer = MemorySink()
    try:
        r = Rollouter(RolloutConfig(n=3, max_tokens=3, groups_per_sync=100, max_concurrent=num_groups, seed=7),
                      [engine], producer, prompts, length_reward)
        await asyncio.wait_for(r.run(num_groups=num_groups), 120)
        groups = {g.sample_id: g for g in producer.groups}
        assert r.replayed == sum(map(is_replayed, groups.values()))
        return groups, engine.stats()["requests"]
    finally:
        await engine.close()


async def test_cache_then_replay_gives_identical_groups_without_engine_requests(model_path, tmp_path):
    first, requests = await run_rollouter(model_path, tmp_path, steps=[0, 1, 2, 3], num_groups=4)
    assert requests == 4 * 3 and not any(map(is_replayed, first.values()))
    second, requests = await run_rollouter(model_path, tmp_path, steps=[0, 1, 2, 3], num_groups=4)
    assert requests == 0
    assert set(second) == set(first)
    for sid, g in second.items():
        assert g == _marked_like(first[sid], g)
        assert g.meta[REPLAY_KEY] == {"role": "async_rollout", "experiment": "t", "step": int(sid.rsplit("_", 1)[1]),
                                      "source_step": int(sid.rsplit("_", 1)[1]), "source_sample_id": sid}


async def test_concurrent_async_samples_resolve_their_own_steps(model_path, tmp_path):
    # Dumps of steps 0..5 (the prompts cycle every 5, so step 5 repeats prompt 0 with other seeds).
    first, _ = await run_rollouter(model_path, tmp_path, steps=None, num_groups=6)
    # Eight samples in flight at once: the listed ones come from their own step's dump, the
    # others from the engine, whatever order they finish in.
    second, requests = await run_rollouter(model_path, tmp_path, steps=[1, 2, 4, 5], num_groups=8)
    replayed = sorted(sid for sid, g in second.items() if is_replayed(g))
    assert replayed == ["sample_0_1", "sample_0_2", "sample_0_4", "sample_1_5"]
    assert requests == 4 * 3  # steps 0, 3, 6, 7 generated
    for sid in replayed:
        assert second[sid].meta[REPLAY_KEY]["source_sample_id"] == sid
        assert second[sid].trajectories == first[sid].trajectories
    assert first["sample_1_5"].trajectories != first["sample_0_0"].trajectories  # distinct dumps, not one reused


async def test_sync_rollout_role_replays_a_train_steps_batch(model_path, tmp_path, rollout_batch):
    from asyncrl.models.tiny import build_tokenizer
    from asyncrl.rollouter.engines.builtin.engine import TorchEngine
    from asyncrl.tasks import arithmetic

    tok = build_tokenizer()
    rows = arithmetic.generate_dataset(4, seed=0)
    SkipManager.init(role_config(tmp_path, steps=[1]), shape={"model": str(model_path)})
    engine = TorchEngine(model_path)
    try:
        kw = dict(n=2, temperature=1.0, max_tokens=3, seed=0)
        SkipManager.set_step(1)
        a = await rollout_batch(engine, tok, rows[2:], first_index=2, **kw)
        before = engine.stats()["requests"]
        b = await rollout_batch(engine, tok, rows[2:], first_index=2, **kw)
        assert engine.stats()["requests"] == before == 2 * 2
    finally:
        await engine.close()
    assert [g.sample_id for g in b] == ["sample_0_2", "sample_0_3"]
    assert all(x.trajectories == y.trajectories for x, y in zip(a, b)) and all(map(is_replayed, b))


@pytest.mark.parametrize("inline_bytes, on_the_loop", [(None, True), (0, False)], ids=["small-inline", "large-thread"])
def test_an_async_caller_reads_a_small_dump_on_its_loop_and_a_large_one_in_a_thread(tmp_path, monkeypatch,
                                                                                    inline_bytes, on_the_loop):
    from asyncrl.skip import manager

    if inline_bytes is not None:
        monkeypatch.setattr(manager, "INLINE_READ_BYTES", inline_bytes)
    threads = []
    replay = manager._replay

    def recording_replay(*args):
        threads.append(threading.current_thread())
        return replay(*args)

    monkeypatch.setattr(manager, "_replay", recording_replay)

    @SkipManager.annotate(role="async_rollout")
    async def make(sample_id: str) -> Group:
        return make_group(int(sample_id.rsplit("_", 1)[1]))

    SkipManager.init(SkipConfig(async_rollout=SkipRoleConfig(enable=True, dump_dir=str(tmp_path))), shape={})

    async def main():
        first = await make("sample_0_5")  # no dump yet: generated, then dumped
        return first, await make("sample_0_5")

    first, again = asyncio.run(main())
    assert is_replayed(again) and again.trajectories == first.trajectories
    assert (threads[-1] is threading.main_thread()) == on_the_loop
