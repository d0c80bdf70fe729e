"""The trainer driver on real ranks: fail closed / drop / staleness policies with acks and syncs,
and a SIGKILL between steps followed by a resume that loses no group and trains none twice.

The SIGKILL test runs this file as the trainer's child process (``python test_trainer.py ...``)
fed by a real ZeroMQ `StreamProducer` in the test process, which keeps every unacked group and
re-sends it when the restarted consumer appears.
"""

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.trainer.batch import IncompleteGroupError
from asyncrl.trainer.config import OptimConfig, TrainerConfig, WorkerConfig
from asyncrl.types import Group, Trajectory

T = 600.0


def make_group(i: int, n: int = 4, version: int = 0, **kw) -> Group:
    """Group ``sample_0_{i}``: deterministic random tokens and rewards from seed ``i``."""
    rng = np.random.default_rng(1000 + i)
    sid = f"sample_0_{i}"
    trajs = []
    for k in range(n):
        r = rng.integers(3, 40, size=int(rng.integers(1, 6)))
        trajs.append(Trajectory(sample_id=sid, index=k, prompt_ids=rng.integers(3, 40, size=4), response_ids=r,
                                logprobs=rng.uniform(-4, -3, size=len(r)).astype(np.float32),
                                versions=np.full(len(r), version, np.int64), finish_reason="stop",
                                reward=float(rng.integers(0, 2))))
    return Group(sample_id=sid, trajectories=trajs, expected=n, **kw)


def trainer_config(model_path, **kw) -> TrainerConfig:
    return TrainerConfig(worker=WorkerConfig(model_path=str(model_path), micro_batch_size=4,
                                             optim=OptimConfig(lr=1e-2)),
                         **{"groups_per_batch": 2, "recv_timeout_s": 5.0, **kw})


# --------------------------------------------------------------------------- policies on Ray ranks


@pytest.fixture(scope="module")
def ray_ranks(tmp_path_factory):
    import ray

    from asyncrl.models.tiny import build_tiny_model
    from asyncrl.placement import start_local_ray
    from asyncrl.trainer.ranks import RankGroup

    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    start_local_ray(num_cpus=2, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    ranks = RankGroup.start_ray(trainer_config(path))
    yield path, ranks
    ranks.close()
    ray.shutdown()


class FakeSyncer:
    """Records sync calls; each one bumps the version like a real weight sync."""

    def __init__(self):
        self.calls = 0

    async def sync(self) -> int:
        self.calls += 1
        return self.calls


async def test_failed_group_fails_closed_and_is_not_acked(ray_ranks):
    from asyncrl.trainer.trainer import MemorySource, Trainer

    path, ranks = ray_ranks
    bad = make_group(2, status="failed", error="engine replica 1 died")
    source = MemorySource([make_group(0), make_group(1), bad, make_group(3)])
    trainer = Trainer(trainer_config(path), ranks, source)
    first = await trainer.train_step()
    assert first.sample_ids == ["sample_0_0", "sample_0_1"]
    with pytest.raises(IncompleteGroupError, match=r"sample_0_2.*engine replica 1 died"):
        await trainer.train_step()
    assert source.acks == [("sample_0_0", None), ("sample_0_1", None)]  # the bad group is never acked
    assert "sample_0_2" not in trainer.committed and trainer.step == 1


async def test_short_group_fails_closed_naming_what_is_missing(ray_ranks):
    from asyncrl.trainer.trainer import MemorySource, Trainer

    path, ranks = ray_ranks
    short = make_group(5)
    short.trajectories = short.trajectories[:3]
    trainer = Trainer(trainer_config(path), ranks, MemorySource([make_group(4), short]))
    with pytest.raises(IncompleteGroupError, match=r"sample_0_5: 3 of 4 trajectories"):
        await trainer.train_step()
    assert trainer.step == 0


async def test_drop_policy_counts_acks_and_continues(ray_ranks):
    from asyncrl.trainer.trainer import MemorySource, Trainer

    path, ranks = ray_ranks
    short = make_group(1)
    short.trajectories = short.trajectories[:2]
    failed = make_group(3, status="failed", error="reward fn raised")
    stale = make_group(6, version=0)
    # Versions: step 1 trains at version 0, then a sync -> 1, step 2 at 1, sync -> 2, ...
    groups = [make_group(0), short, make_group(2), failed, make_group(4, version=1), make_group(5, version=1), stale,
              make_group(7, version=2), make_group(8, version=2)]
    source = MemorySource(groups)
    syncer = FakeSyncer()
    cfg = trainer_config(path, on_incomplete_group="drop", max_version_gap=1, trigger_parameter_sync_step=1)
    trainer = Trainer(cfg, ranks, source, syncer)
    results = await trainer.run(3)
    assert [r.sample_ids for r in results] == [["sample_0_0", "sample_0_2"], ["sample_0_4", "sample_0_5"],
                                               ["sample_0_7", "sample_0_8"]]
    assert results[0].metrics["dropped_incomplete"] == 1 and results[1].metrics["dropped_incomplete"] == 1
    # sample_0_6 (version 0) arrives at trainer version 2: gap 2 > max_version_gap=1.
    assert results[2].metrics["dropped_stale"] == 1
    acks = dict(source.acks)
    assert acks["sample_0_1"].startswith("incomplete: 2 of 4 trajectories")
    assert acks["sample_0_3"].startswith("incomplete: failed: reward fn raised")
    assert acks["sample_0_6"].startswith("stale: oldest token version 0")
    assert syncer.calls == 3 and trainer.version == 3
    assert results[1].metrics["staleness_max"] == 0.0  # trained at version 1 on version-1 tokens


async def test_replayed_groups_are_acked_again_never_trained_twice(ray_ranks):
    from asyncrl.trainer.trainer import MemorySource, Trainer

    path, ranks = ray_ranks
    # A producer that lost its acks replays sample_0_0 and sample_0_1 after they were trained.
    source = MemorySource([make_group(0), make_group(1), make_group(0), make_group(2), make_group(1), make_group(3)])
    trainer = Trainer(trainer_config(path), ranks, source)
    results = await trainer.run(2)
    assert [r.sample_ids for r in results] == [["sample_0_0", "sample_0_1"], ["sample_0_2", "sample_0_3"]]
    assert [sid for sid, _ in source.acks] == ["sample_0_0", "sample_0_1", "sample_0_0", "sample_0_1",
                                               "sample_0_2", "sample_0_3"]


async def test_recomputed_logprobs_match_engine_behaviour_logprobs(ray_ranks):
    # Same weights in the engine and the trainer: the trainer's recomputed log-prob of every
    # response token must equal the engine's behaviour log-prob (this catches any off-by-one
    # in positions, masks or padding). Prompts and responses of mixed lengths pad differently.
    from asyncrl.models.tiny import build_tokenizer
    from asyncrl.rollouter.engines.builtin.engine import TorchEngine
    from asyncrl.trainer.batch import assemble
    from asyncrl.types import GenerateRequest, SamplingParams

    from asyncrl.sync.inprocess import InProcessSyncer

    path, ranks = ray_ranks
    tok = build_tokenizer()
    engine = TorchEngine(str(path), max_running=8)
    # Earlier tests trained the ranks: load their weights into the engine (pause, load, resume).
    assert await InProcessSyncer(ranks, [engine]).sync() == 1 and engine.version == 1
    prompts = ["1+2=", "13+29=", "7*(3+4)=?", "a"]
    groups = []
    try:
        for i, text in enumerate(prompts):
            ids = np.asarray([tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"]], np.int64)
            results = await asyncio.gather(*[
                engine.generate(GenerateRequest(request_id=f"p{i}r{k}", prompt_ids=ids, max_tokens=3 + 5 * k,
                                                sampling=SamplingParams(temperature=1.0, seed=100 * i + k)))
                for k in range(2)
            ])
            trajs = [Trajectory(sample_id=f"sample_0_{i}", index=k, prompt_ids=ids, response_ids=r.response_ids,
                                logprobs=r.logprobs, versions=r.versions, finish_reason=r.finish_reason)
                     for k, r in enumerate(results)]
            groups.append(Group(sample_id=f"sample_0_{i}", trajectories=trajs, expected=2))
    finally:
        await engine.close()
    batch = assemble(groups)
    mask = batch["response_mask"].bool()
    assert mask.sum() >= 20 and len(set(mask.sum(-1).tolist())) > 1  # mixed response lengths
    assert batch["versions"][mask].eq(1).all()  # every token sampled after the weight load
    recomputed = (await ranks.call("compute_logprobs", [(batch,)], timeout=T))[0]
    diff = (recomputed - batch["old_logprobs"])[mask].abs().max().item()
    assert diff <= 1e-4, f"max abs logprob diff {diff}"
    # Shifting by one position breaks the match: the comparison is sensitive to alignment.
    shifted = torch.roll(recomputed, 1, dims=1)
    assert (shifted - batch["old_logprobs"])[mask].abs().max().item() > 1e-2


# --------------------------------------------------------------------------- SIGKILL and resume

N_GROUPS, STEPS = 16, 4  # 4 groups per step (2 mini-batches of 2 groups); checkpoint every 2 steps


def stream_config(endpoint: str):
    from asyncrl.queue import StreamConfig

    return StreamConfig(endpoint=endpoint, window=N_GROUPS, heartbeat_s=0.1, peer_timeout_s=1.0)


async def child_main(args) -> None:
    """The trainer process: resumes from --ckpt if it can, consumes the stream (or, with
    --memory, groups 0..N-1 in order), prints each step, optionally waits on stdin between steps."""
    import torch
    from safetensors.torch import save_file

    from asyncrl.queue import StreamConsumer
    from asyncrl.trainer.ranks import RankGroup
    from asyncrl.trainer.trainer import MemorySource, Trainer

    torch.set_num_threads(1)
    cfg = trainer_config(args.model, require_batches=2, checkpoint_dir=args.ckpt, checkpoint_every=2,
                         recv_timeout_s=60.0)
    ranks = RankGroup.start_local(cfg)
    trainer = Trainer(cfg, ranks, MemorySource(), rollouter_state=lambda: {"feed_index": 4 * trainer.step})
    restored = await trainer.restore()
    if args.memory:
        source = MemorySource(make_group(i) for i in range(N_GROUPS))
    else:
        # The consumer starts from the checkpoint's committed set: replays of those are acked, not delivered.
        source = StreamConsumer(stream_config(args.endpoint), committed=trainer.committed)
        await source.start()
    trainer.source = source
    print(json.dumps({"restored": restored, "step": trainer.step, **trainer.restored_rollouter_state}), flush=True)
    while trainer.step < STEPS:
        result = await trainer.train_step()
        print(json.dumps({"step": result.step, "ids": result.sample_ids}), flush=True)
        if args.pause:
            await asyncio.to_thread(sys.stdin.readline)  # the parent kills us here: between two steps
    params = (await ranks.call("full_state_dict", timeout=T))[0]
    save_file({k: v.clone() for k, v in params.items()}, args.out)
    if not args.memory:
        await source.close()
    ranks.close()


async def spawn_child(model, ckpt, out, *extra):
    cmd = [sys.executable, __file__, "--model", str(model), "--ckpt", str(ckpt), "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return await asyncio.create_subprocess_exec(*cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                                cwd=Path(__file__).resolve().parents[2])


async def read_line(proc) -> dict:
    line = await asyncio.wait_for(proc.stdout.readline(), T)
    assert line, f"child {proc.pid} exited with {await proc.wait()}"
    return json.loads(line)


async def read_all(proc) -> list[dict]:
    lines = [json.loads(line) for line in (await asyncio.wait_for(proc.communicate(), T))[0].splitlines()]
    assert proc.returncode == 0
    return lines


async def test_sigkill_between_steps_then_resume_loses_nothing_and_trains_nothing_twice(tmp_path):
    from safetensors.torch import load_file

    from asyncrl.models.tiny import build_tiny_model
    from asyncrl.queue import StreamProducer
    from asyncrl.net import free_port

    model = build_tiny_model(tmp_path / "model")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    producer = StreamProducer(stream_config(endpoint), producer_id="rollouter")
    await producer.start()
    sending = asyncio.create_task(_send_all(producer))
    try:
        # Run 1: killed after step 3, i.e. with step 3 trained but not yet checkpointed nor acked.
        proc = await spawn_child(model, tmp_path / "ckpt", tmp_path / "unused.safetensors", "--endpoint", endpoint,
                                 "--pause")
        try:
            assert await read_line(proc) == {"restored": False, "step": 0}
            run1 = [await read_line(proc)]
            for _ in range(2):
                proc.stdin.write(b"go\n")
                await proc.stdin.drain()
                run1.append(await read_line(proc))
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
        assert proc.returncode == -signal.SIGKILL
        await asyncio.wait_for(sending, T)  # the window holds all groups: every one was sent
        committed_run1 = [sid for rec in run1[:2] for sid in rec["ids"]]  # steps 1-2 were checkpointed
        # The producer still holds exactly what is not durable: step 3's groups and the rest.
        assert {g.sample_id for g in producer.unacked} == {f"sample_0_{i}" for i in range(N_GROUPS)} - set(
            committed_run1)

        # Run 2: resume; the producer re-sends its unacked groups to the new consumer session.
        proc = await spawn_child(model, tmp_path / "ckpt", tmp_path / "resumed.safetensors", "--endpoint", endpoint)
        first, *run2 = await read_all(proc)
        assert first == {"restored": True, "step": 2, "feed_index": 8}  # the Rollouter's slot came back
        await producer.wait_acked(timeout=T)  # every group acked: none lost
    finally:
        sending.cancel()
        await producer.close()
    trained_after = [sid for rec in run2 for sid in rec["ids"]]
    assert not set(trained_after) & set(committed_run1), "a committed group was trained again"
    assert [rec["step"] for rec in run2] == [3, 4]
    assert run2[0]["ids"] == run1[2]["ids"]  # the lost step 3 is redone with the same groups

    # Run 3: uninterrupted, fed the same groups in the same order.
    proc = await spawn_child(model, tmp_path / "ckpt_ref", tmp_path / "ref.safetensors", "--memory")
    first, *run3 = await read_all(proc)
    assert first == {"restored": False, "step": 0}
    reference = [sid for rec in run3 for sid in rec["ids"]]
    assert committed_run1 + trained_after == reference == [f"sample_0_{i}" for i in range(N_GROUPS)]
    resumed, ref = load_file(tmp_path / "resumed.safetensors"), load_file(tmp_path / "ref.safetensors")
    assert resumed.keys() == ref.keys()
    for k in ref:
        assert (resumed[k] - ref[k]).abs().max().item() <= 1e-6, k


async def _send_all(producer) -> None:
    for i in range(N_GROUPS):
        await producer.send(make_group(i))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--ckpt")
    parser.add_argument("--out")
    parser.add_argument("--endpoint")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--pause", action="store_true")
    asyncio.run(child_main(parser.parse_args()))
