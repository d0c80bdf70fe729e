"""The Trainer's durability on a real (in-process, gloo) rank: samples.jsonl written only once a
step is durable and repaired at resume, the committed set in the sidecar, a final checkpoint,
and a stop that abandons a step still collecting."""

import asyncio
import json

import numpy as np
import torch
import pytest

from asyncrl.trainer import checkpoint
from asyncrl.trainer.config import OptimConfig, TrainerConfig, WorkerConfig
from asyncrl.trainer.trainer import MemorySource, StepAbandoned, Trainer
from asyncrl.types import CommittedSet, Group, Trajectory


def make_group(i: int, n: int = 4) -> Group:
    """Group ``sample_0_{i}``: deterministic random tokens and rewards from seed ``i``."""
    rng = np.random.default_rng(1000 + i)
    sid = f"sample_0_{i}"
    trajs = []
    for k in range(n):
        r = rng.integers(3, 40, size=int(rng.integers(1, 6)))
        trajs.append(Trajectory(sample_id=sid, index=k, prompt_ids=rng.integers(3, 40, size=4), response_ids=r,
                                logprobs=rng.uniform(-4, -3, size=len(r)).astype(np.float32),
                                versions=np.zeros(len(r), np.int64), finish_reason="stop",
                                reward=float(rng.integers(0, 2))))
    return Group(sample_id=sid, trajectories=trajs, expected=n)


def trainer_config(model_path, **kw) -> TrainerConfig:
    return TrainerConfig(worker=WorkerConfig(model_path=str(model_path), micro_batch_size=4,
                                             optim=OptimConfig(lr=1e-2)),
                         **{"groups_per_batch": 2, "recv_timeout_s": 5.0, **kw})


@pytest.fixture(scope="module")
def local_rank(tmp_path_factory):
    import torch

    from asyncrl.models.tiny import build_tiny_model
    from asyncrl.trainer.ranks import RankGroup

    torch.set_num_threads(1)
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    ranks = RankGroup.start_local(trainer_config(path))
    yield path, ranks
    ranks.close()


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_samples_are_logged_once_their_step_is_durable_and_the_last_step_is_checkpointed(local_rank, tmp_path):
    path, ranks = local_rank
    short = make_group(2)
    short.trajectories = short.trajectories[:3]
    # Arrival order 1, 0: the step trains them in feed order.
    source = MemorySource([make_group(1), make_group(0), short, make_group(3), make_group(4), make_group(5),
                           make_group(6)])
    log = tmp_path / "samples.jsonl"
    cfg = trainer_config(path, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2, samples_path=str(log),
                         on_incomplete_group="drop")
    trainer = Trainer(cfg, ranks, source, rollouter_state=lambda: {"next_index": 7})
    first = await trainer.train_step()
    assert first.sample_ids == ["sample_0_0", "sample_0_1"]
    assert lines(log) == [] and source.acks == []  # step 1 is not durable yet: nothing logged, nothing acked
    await trainer.train_step()
    assert [(r["sample_id"], r["step"], r["status"]) for r in lines(log)] == [
        ("sample_0_0", 1, "trained"), ("sample_0_1", 1, "trained"), ("sample_0_2", 2, "dropped"),
        ("sample_0_3", 2, "trained"), ("sample_0_4", 2, "trained")]
    assert lines(log)[2]["reason"].startswith("incomplete: 3 of 4 trajectories")
    await trainer.train_step()  # step 3: 5 and 6; checkpoint_every=2 would skip it
    assert len(lines(log)) == 5
    await trainer.finish()
    assert [r["sample_id"] for r in lines(log)][5:] == ["sample_0_5", "sample_0_6"]
    path3, state = checkpoint.latest(cfg.checkpoint_dir)
    assert path3.name == "step_000003" and state.step == 3 and state.dropped == 1
    assert CommittedSet.from_json(state.committed) == {f"sample_0_{i}" for i in range(7)}
    assert state.committed == {"watermark": 7, "epochs": [[0, 0]], "exceptions": []}
    assert [r["sample_id"] for r in state.records] == ["sample_0_5", "sample_0_6"]
    assert state.rollouter_state == {"next_index": 7}
    assert sorted(sid for sid, _ in source.acks) == [f"sample_0_{i}" for i in range(7)]
    await trainer.finish()  # nothing new: no new checkpoint, no new line
    assert len(lines(log)) == 7 and checkpoint.latest(cfg.checkpoint_dir)[0].name == "step_000003"


async def test_resume_repairs_samples_jsonl_to_exactly_what_the_checkpoint_made_durable(local_rank, tmp_path):
    path, ranks = local_rank
    log = tmp_path / "samples.jsonl"
    cfg = trainer_config(path, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1, samples_path=str(log))
    trainer = Trainer(cfg, ranks, MemorySource(make_group(i) for i in range(4)))
    await trainer.run(2)
    good = lines(log)
    assert [r["sample_id"] for r in good] == [f"sample_0_{i}" for i in range(4)]
    # A crash right after publishing step 2, with its lines half written, after a line that a
    # later (lost) step would have written.
    text = log.read_text().splitlines(keepends=True)
    log.write_text("".join(text[:2]) + json.dumps({"sample_id": "sample_0_9", "step": 3, "status": "trained",
                                                   "reason": None}) + "\n" + text[2][:17])
    resumed = Trainer(cfg, ranks, MemorySource())
    assert await resumed.restore()
    assert resumed.step == 2 and resumed.committed == {f"sample_0_{i}" for i in range(4)}
    assert lines(log) == good  # the torn line and the line of a group not durable are gone; step 2's are back
    assert await resumed.restore() and lines(log) == good  # repairing twice changes nothing


async def test_a_run_restarted_before_its_first_checkpoint_clears_samples_jsonl(local_rank, tmp_path):
    # The first attempt trained two steps, staged step 2's checkpoint and wrote its lines, and died
    # before publishing it (no ``latest``): nothing it did is durable, and the restarted run trains
    # every id again, so a line left in samples.jsonl would list an id twice.
    path, ranks = local_rank
    log = tmp_path / "samples.jsonl"
    cfg = trainer_config(path, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1, samples_path=str(log))
    first = Trainer(cfg, ranks, MemorySource(make_group(i) for i in range(4)))
    await first.run(2)
    assert len(lines(log)) == 4
    (tmp_path / "ckpt" / "latest").unlink()
    assert checkpoint.latest(cfg.checkpoint_dir) is None
    again = Trainer(cfg, ranks, MemorySource(make_group(i) for i in range(4)))
    assert not await again.restore()
    assert again.step == 0 and lines(log) == []
    await again.run(1)
    assert [r["sample_id"] for r in lines(log)] == ["sample_0_0", "sample_0_1"]


async def test_a_stop_abandons_a_step_still_collecting_and_finish_makes_the_rest_durable(local_rank, tmp_path):
    path, ranks = local_rank
    log = tmp_path / "samples.jsonl"
    cfg = trainer_config(path, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=10, samples_path=str(log),
                         recv_timeout_s=600.0)

    class Trickle(MemorySource):
        """Hands out its groups, then waits (as a stream with nothing to send does)."""

        async def recv(self, timeout=None):
            if not self._queue:
                await asyncio.Event().wait()
            return await super().recv(timeout)

    source = Trickle(make_group(i) for i in range(3))
    trainer = Trainer(cfg, ranks, source)
    await trainer.train_step()
    step = asyncio.create_task(trainer.train_step())  # gets sample_0_2, then waits for a fourth group
    await asyncio.sleep(0)
    trainer.request_stop()
    with pytest.raises(StepAbandoned, match="step 2 was collecting"):
        await asyncio.wait_for(step, 60)
    assert trainer.step == 1 and "sample_0_2" not in trainer.committed
    await trainer.finish()
    assert [r["sample_id"] for r in lines(log)] == ["sample_0_0", "sample_0_1"]
    assert [sid for sid, _ in source.acks] == ["sample_0_0", "sample_0_1"]  # sample_0_2 stays unacked
    with pytest.raises(StepAbandoned):
        await trainer.train_step()


async def test_a_run_stopped_in_its_weight_sync_runs_that_sync_at_resume(local_rank, tmp_path):
    # The Rollouter died while the sync after step 1 was due (NotifyingSyncer's first call
    # fails): step 1 is trained and checkpointed, but its weights never became version 1. The
    # resume must publish them as version 1, as an uninterrupted run would; republishing them as
    # version 0 leaves an on-policy Rollouter's staleness budget spent, and the run waits forever.
    from asyncrl.rollouter.engines.builtin.engine import TorchEngine
    from asyncrl.sync.inprocess import InProcessSyncer

    path, ranks = local_rank
    cfg = trainer_config(path, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=10,
                         samples_path=str(tmp_path / "samples.jsonl"))

    class RollouterGone:
        async def sync(self) -> int:
            raise RuntimeError("the Rollouter actor died")

    trainer = Trainer(cfg, ranks, MemorySource(make_group(i) for i in range(2)), RollouterGone())
    with pytest.raises(RuntimeError, match="Rollouter actor died"):
        await trainer.train_step()
    assert trainer.step == 1 and trainer.version == 0 and trainer.sync_due
    await trainer.finish()  # what the launcher does before it stops on the failure
    _, state = checkpoint.latest(cfg.checkpoint_dir)
    assert state.step == 1 and state.version == 0 and state.sync_due

    resumed = Trainer(cfg, ranks, MemorySource())
    assert await resumed.restore() and resumed.step == 1 and resumed.version == 0 and resumed.sync_due
    engine = TorchEngine(str(path))
    try:
        full = (await ranks.call("full_state_dict", timeout=60))[0]  # step 1's weights

        def serves_step_1() -> bool:
            served = dict(engine.model.named_parameters())
            return all(torch.equal(served[k], v) for k, v in full.items() if k in served)

        assert engine.version == 0 and not serves_step_1()
        assert await resumed.catch_up_sync(InProcessSyncer(ranks, [engine])) is True
        assert resumed.version == 1 and engine.version == 1 and not resumed.sync_due and serves_step_1()
        assert await resumed.catch_up_sync(InProcessSyncer(ranks, [engine])) is False  # nothing due now
        assert engine.version == 1

        # A step whose sync finished is checkpointed with nothing due.
        resumed.source = MemorySource(make_group(i) for i in range(2, 4))
        resumed.syncer = InProcessSyncer(ranks, [engine])
        await resumed.train_step()
        await resumed.finish()
        _, state = checkpoint.latest(cfg.checkpoint_dir)
        assert state.step == 2 and state.version == 2 and not state.sync_due and engine.version == 2
    finally:
        await engine.close()
