"""The trainer driver on real ranks: fail closed / drop / staleness policies with acks and syncs,
and a SIGKILL between steps followed by a resume that loses no group and trains none twice.

The SIGKILL test runs this file as the child process (``python test_trainer.py --child ...``):
the child trains from `ReplaySource`, a deterministic source that, like the stream's producer,
re-sends every group not yet acked (its acks persist in a file).
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
                         groups_per_batch=2, recv_timeout_s=5.0, **kw)


# --------------------------------------------------------------------------- policies on Ray ranks


@pytest.fixture(scope="module")
def ray_ranks(tmp_path_factory):
    import ray

    from asyncrl.models.tiny import build_tiny_model
    from asyncrl.trainer.ranks import RankGroup

    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
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


async def test_recomputed_logprobs_match_engine_behaviour_logprobs(ray_ranks):
    # Same weights in the engine and the trainer: the trainer's recomputed log-prob of every
    # response token must equal the engine's behaviour log-prob (this catches any off-by-one
    # in positions, masks or padding). Prompts and responses of mixed lengths pad differently.
    from asyncrl.models.tiny import build_tokenizer
    from asyncrl.rollouter.torch_engine import TorchEngine
    from asyncrl.trainer.batch import assemble
    from asyncrl.types import GenerateRequest, SamplingParams

    path, ranks = ray_ranks
    tok = build_tokenizer()
    engine = TorchEngine(str(path), max_running=8)
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
    recomputed = (await ranks.call("compute_logprobs", [(batch,)], timeout=T))[0]
    diff = (recomputed - batch["old_logprobs"])[mask].abs().max().item()
    assert diff <= 1e-4, f"max abs logprob diff {diff}"
    # Shifting by one position breaks the match: the comparison is sensitive to alignment.
    shifted = torch.roll(recomputed, 1, dims=1)
    assert (shifted - batch["old_logprobs"])[mask].abs().max().item() > 1e-2


# --------------------------------------------------------------------------- SIGKILL and resume

N_GROUPS, STEPS = 16, 4  # 4 groups per step (2 mini-batches of 2 groups)


class ReplaySource:
    """Groups 0..count-1 in order, minus those acked in ``ack_log`` (or all of them with
    ``replay_all``, as a producer would after losing its ack state); acks append to the log."""

    def __init__(self, count: int, ack_log: Path, replay_all: bool = False):
        acked = set(ack_log.read_text().split()) if ack_log.exists() else set()
        self.pending = [i for i in range(count) if replay_all or f"sample_0_{i}" not in acked]
        self.ack_log = ack_log

    async def recv(self, timeout=None) -> Group:
        if not self.pending:
            raise TimeoutError("ReplaySource is empty")
        return make_group(self.pending.pop(0))

    def ack(self, sample_ids, reason=None) -> None:
        with open(self.ack_log, "a") as f:
            f.writelines(f"{sid}\n" for sid in sample_ids)
            f.flush()
            os.fsync(f.fileno())


async def child_main(args) -> None:
    import torch
    from safetensors.torch import save_file

    from asyncrl.trainer.ranks import RankGroup
    from asyncrl.trainer.trainer import Trainer

    torch.set_num_threads(1)
    cfg = trainer_config(args.model, require_batches=2, checkpoint_dir=args.ckpt, checkpoint_every=2)
    ranks = RankGroup.start_local(cfg)
    trainer = Trainer(cfg, ranks, ReplaySource(N_GROUPS, Path(args.acks), replay_all=args.replay_all))
    restored = await trainer.restore()
    print(json.dumps({"restored": restored, "step": trainer.step}), flush=True)
    while trainer.step < STEPS:
        result = await trainer.train_step()
        print(json.dumps({"step": result.step, "ids": result.sample_ids}), flush=True)
        if args.pause:
            sys.stdin.readline()  # the parent kills us here: between two steps
    await trainer.save_checkpoint()
    params = (await ranks.call("full_state_dict", timeout=T))[0]
    save_file({k: v.clone() for k, v in params.items()}, args.out)
    ranks.close()


def spawn_child(model, ckpt, acks, out, *extra):
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--ckpt", str(ckpt), "--acks", str(acks),
           "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[2])


def read_steps(proc) -> list[dict]:
    lines = [json.loads(line) for line in proc.stdout]
    assert proc.wait(timeout=T) == 0
    return lines


def test_sigkill_between_steps_then_resume_loses_nothing_and_trains_nothing_twice(tmp_path):
    from safetensors.torch import load_file

    from asyncrl.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    # Run 1: checkpoint every 2 steps; killed after step 3, i.e. with step 3 trained but not durable.
    acks = tmp_path / "acks.txt"
    proc = spawn_child(model, tmp_path / "ckpt", acks, tmp_path / "unused.safetensors", "--pause")
    try:
        assert json.loads(proc.stdout.readline()) == {"restored": False, "step": 0}
        run1 = []
        while len(run1) < 3:
            run1.append(json.loads(proc.stdout.readline()))
            if len(run1) < 3:
                proc.stdin.write("go\n")
                proc.stdin.flush()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=T)
    assert proc.returncode == -signal.SIGKILL
    committed_run1 = [sid for rec in run1[:2] for sid in rec["ids"]]  # steps 1-2 were checkpointed
    assert sorted(acks.read_text().split()) == sorted(committed_run1)  # step 3 was trained, never acked

    # Run 2: resume; the source re-sends everything (worst case), the trainer must skip what is committed.
    proc = spawn_child(model, tmp_path / "ckpt", acks, tmp_path / "resumed.safetensors", "--replay-all")
    first, *run2 = read_steps(proc)
    assert first == {"restored": True, "step": 2}
    trained_after = [sid for rec in run2 for sid in rec["ids"]]
    assert not set(trained_after) & set(committed_run1), "a committed group was trained again"
    assert [rec["step"] for rec in run2] == [3, 4]
    assert run2[0]["ids"] == run1[2]["ids"]  # the lost step 3 is redone with the same groups

    # Run 3: uninterrupted, same groups.
    proc = spawn_child(model, tmp_path / "ckpt_ref", tmp_path / "acks_ref.txt", tmp_path / "ref.safetensors")
    first, *run3 = read_steps(proc)
    assert first == {"restored": False, "step": 0}
    reference = [sid for rec in run3 for sid in rec["ids"]]
    assert committed_run1 + trained_after == reference == [f"sample_0_{i}" for i in range(N_GROUPS)]
    # Every group acked, none lost (duplicates are re-acks of replayed, already durable groups).
    assert set(acks.read_text().split()) == set(reference)
    resumed, ref = load_file(tmp_path / "resumed.safetensors"), load_file(tmp_path / "ref.safetensors")
    assert resumed.keys() == ref.keys()
    for k in ref:
        assert (resumed[k] - ref[k]).abs().max().item() <= 1e-6, k


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--model")
    parser.add_argument("--ckpt")
    parser.add_argument("--acks")
    parser.add_argument("--out")
    parser.add_argument("--pause", action="store_true")
    parser.add_argument("--replay-all", action="store_true")
    asyncio.run(child_main(parser.parse_args()))
