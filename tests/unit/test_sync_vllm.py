"""The ``vllm`` weight-sync backend on CPU, with stand-ins for what needs CUDA (NCCL, vLLM's NCCL engine).

The trainer half (`VLLMWeightSender`) runs for real except its NCCL communicator; the engine
half runs inside a real `EngineActor` whose `VLLMEngine` holds the stand-in ``AsyncLLM`` of
test_vllm_engine.py (reporting vLLM 0.33, and 0.32 where a branch differs); the
`WeightSyncCoordinator` drives both through actor-handle stand-ins (``handle.method.remote(...)``
returns an awaitable, as a Ray handle's ObjectRef is). vLLM's CPU build cannot run this path
(it has no NCCL); the vLLM engine itself runs against it in tests/integration/test_vllm_real.py.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from asyncrl.sync.backends import make_sender
from asyncrl.sync.base import GroupInit, JoinThread, SenderInit
from asyncrl.sync.coordinator import WeightSyncConfig, WeightSyncCoordinator
from asyncrl.sync.vllm import VLLMSyncConfig, VLLMWeightSender, VLLMWeightSyncError, plan_vllm_buckets
from asyncrl.sync.wire import WeightSyncError
from tests.unit.test_vllm_engine import fake_vllm  # noqa: F401 - the stand-in vLLM modules

CPU = torch.device("cpu")


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


class _Handle:
    """A Ray actor handle stand-in: ``handle.m.remote(*a)`` runs ``obj.m`` (sync ones in a thread)."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        fn = getattr(self._obj, name)

        def remote(*args, **kwargs):
            if asyncio.iscoroutinefunction(fn):
                return asyncio.ensure_future(fn(*args, **kwargs))
            return asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))

        return SimpleNamespace(remote=remote)


class _Comm:
    """Stands in for vLLM's PyNcclCommunicator on trainer rank 0: records what is broadcast."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []

    def broadcast(self, buf, src, stream):
        assert src == 0
        self.sent.append(buf.clone())

    def destroy(self):
        pass


class _TrainerRank:
    """The weight-sync entry points of `TrainerWorker`, around a plain model."""

    def __init__(self, model, rank=0):
        self.model, self.rank, self.sender, self.inits = model, rank, None, []

    def init_weight_sync(self, init):
        self.inits.append(init)
        self.sender = make_sender(self.model, rank=self.rank, init=init)
        return self.sender.connect()

    def weight_update_kwargs(self, *, version):
        return self.sender.update_kwargs(version=version)

    def send_weights(self, **kw):
        return self.sender.send(**kw)


@pytest.fixture
def cpu_sender(monkeypatch):
    """Trainer rank 0 joins at once, on CPU, with a recording communicator."""
    comm = _Comm()
    monkeypatch.setattr(VLLMWeightSender, "_device", staticmethod(lambda: CPU))
    monkeypatch.setattr(VLLMWeightSender, "_start_join",
                        lambda self: JoinThread(lambda: comm, name="test-join", error=VLLMWeightSyncError))
    return comm


# vLLM 0.32's packed receiver has no ordering between its buffers: its engines unpack with one
@pytest.mark.parametrize("vllm_version, engine_buffers", [("0.33.0", 2), ("0.32.0", 1)])
async def test_two_workers_per_engine_geometry_and_engine_dtype_on_the_wire(fake_vllm, cpu_sender, tmp_path,  # noqa: F811
                                                                            monkeypatch, vllm_version, engine_buffers):
    from asyncrl.rollouter.actor import EngineActor

    monkeypatch.setattr(sys.modules["vllm"], "__version__", vllm_version)
    (tmp_path / "config.json").write_text('{"eos_token_id": 2}')
    engines = {n: EngineActor(kind="vllm", model_path=tmp_path, dtype="bfloat16") for n in ("e0", "e1")}
    model = _model()
    trainer = _TrainerRank(model)
    cfg = WeightSyncConfig(method="vllm", workers_per_engine=2, bucket_mb=0.001, connect_timeout_s=30)
    coord = WeightSyncCoordinator([_Handle(trainer)], {n: _Handle(a) for n, a in engines.items()}, cfg)
    assert await coord.sync() == 1

    (init,) = trainer.inits
    assert init.method == "vllm" and init.workers_per_engine == 2 and init.group.world_size == 5
    assert init.wire_dtype == "bfloat16"  # asked from the engines (WeightSyncConfig.wire_dtype="engine")
    infos = [next(c[1] for c in a.engine.llm.calls if c[0] == "init") for a in engines.values()]
    assert [i["rank_offset"] for i in infos] == [1, 3] and {i["world_size"] for i in infos} == {5}
    assert trainer.sender.config.num_buffers == 2 and {i["packed_num_buffers"] for i in infos} == {engine_buffers}
    # vLLM's worker rank is rank_offset + rank within the engine (tp=2): 1..4 once each, after the trainer's 0
    assert sorted(i["rank_offset"] + r for i in infos for r in range(2)) == [1, 2, 3, 4]
    for actor in engines.values():
        ops = [c[0] for c in actor.engine.llm.calls]
        assert ops == ["pause", "init", "start", "update", "finish", "label", "resume"]  # the group is formed while paused
        (update,) = [c[1] for c in actor.engine.llm.calls if c[0] == "update"]
        assert update["names"] == [n for n, _ in model.named_parameters()]
        assert set(update["dtype_names"]) == {"bfloat16"}
        assert actor.engine.version == 1
    # bf16 on the wire: half of fp32's bytes, exactly the parameters cast to bf16
    sent = torch.cat(cpu_sender.sent)
    assert sent.numel() == sum(p.numel() for p in model.parameters()) * 2
    assert torch.equal(sent, torch.cat([p.detach().to(torch.bfloat16).reshape(-1).view(torch.uint8)
                                        for p in model.parameters()]))

    # fp32 kept on request
    trainer32 = _TrainerRank(model)
    engine32 = EngineActor(kind="vllm", model_path=tmp_path)
    cpu_sender.sent.clear()
    coord32 = WeightSyncCoordinator([_Handle(trainer32)], [_Handle(engine32)],
                                    WeightSyncConfig(method="vllm", wire_dtype="float32", bucket_mb=0.001))
    assert await coord32.sync() == 1
    assert sum(b.numel() for b in cpu_sender.sent) == sum(p.numel() for p in model.parameters()) * 4


async def test_vllm_method_is_refused_by_the_builtin_engine(model_path):
    from asyncrl.rollouter.actor import EngineActor
    from asyncrl.sync.base import ReceiverInit

    actor = EngineActor(kind="torch", model_path=model_path)
    with pytest.raises(ValueError, match="receives weights with method 'broadcast', not 'vllm'.*method='broadcast'"):
        await actor.init_weight_sync(ReceiverInit(method="vllm"))
    await actor.close()


def test_vllm_config_refuses_deadlines_vllm_would_not_keep():
    with pytest.raises(ValueError, match="connect_timeout_s=600.*<= 300"):
        WeightSyncConfig(method="vllm", connect_timeout_s=600)
    with pytest.raises(ValueError, match="VLLMSyncConfig.join_timeout_s=301"):
        VLLMSyncConfig(join_timeout_s=301)
    with pytest.raises(ValueError, match="workers_per_engine must be >= 1"):
        WeightSyncConfig(workers_per_engine=0)
    with pytest.raises(ValueError, match="WeightSyncConfig.method"):
        WeightSyncConfig(method="ipc")


def _counting_gathers(monkeypatch):
    import asyncrl.sync.vllm.protocol as backend  # where iter_full_tensors gathers

    seen = []

    def full(p):
        seen.append(p)  # each call stands for one FSDP2 all-gather the other ranks are waiting in
        return p

    monkeypatch.setattr(backend, "full_tensor", full)
    return seen


def test_failed_join_still_runs_every_gather(monkeypatch):
    # Rank 0's join fails: it must still take part in every all-gather, or the other ranks hang.
    seen = _counting_gathers(monkeypatch)
    monkeypatch.setattr(VLLMWeightSender, "_device", staticmethod(lambda: CPU))

    def refused():
        raise ConnectionRefusedError("no engine listening")

    monkeypatch.setattr(VLLMWeightSender, "_start_join",
                        lambda self: JoinThread(refused, name="test-join", error=VLLMWeightSyncError))
    model = _model()
    sender = VLLMWeightSender(model, rank=0, workers_per_engine=[1])
    sender.connect()
    with pytest.raises(VLLMWeightSyncError, match="no engine listening"):
        sender.send(version=1)
    assert len(seen) == len(list(model.parameters()))


def test_join_deadline_is_the_configured_one_and_gathers_still_run(monkeypatch):
    seen = _counting_gathers(monkeypatch)
    monkeypatch.setattr(VLLMWeightSender, "_device", staticmethod(lambda: CPU))
    never = threading.Event()
    monkeypatch.setattr(VLLMWeightSender, "_start_join",
                        lambda self: JoinThread(never.wait, name="test-join", error=VLLMWeightSyncError))
    model = _model()
    sender = VLLMWeightSender(model, rank=0, workers_per_engine=[2], config=VLLMSyncConfig(join_timeout_s=0.2))
    (init,) = sender.connect()
    assert init.group.join_timeout_s == 0.2 and init.group.world_size == 3
    with pytest.raises(WeightSyncError, match="did not finish within timeout_s=0.2s"):
        sender.send(version=1)
    assert len(seen) == len(list(model.parameters()))
    never.set()


def test_broadcast_failure_mid_send_still_runs_every_gather(monkeypatch, cpu_sender):
    seen = _counting_gathers(monkeypatch)
    model = _model()
    sender = VLLMWeightSender(model, rank=0, workers_per_engine=[1], config=VLLMSyncConfig(bucket_mb=0.0001))
    sender.connect()
    assert len(plan_vllm_buckets([m.nbytes for m in sender.metas()], sender.config.bucket_bytes)) > 1

    def broken(buf, src, stream):
        raise RuntimeError("NCCL error: unhandled system error")

    cpu_sender.broadcast = broken
    with pytest.raises(VLLMWeightSyncError, match="version 1 to vLLM failed: NCCL error"):
        sender.send(version=1)
    assert len(seen) == len(list(model.parameters()))
    assert sender.update_kwargs(version=2)["names"]  # metadata is announced again after a failure


def test_sender_init_from_group_is_typed():
    init = SenderInit(method="vllm", workers_per_engine=2, group=GroupInit(world_size=5, timeout_s=10.0))
    sender = make_sender(_model(), rank=1, init=init)
    assert isinstance(sender, VLLMWeightSender) and sender.workers_per_engine == [2, 2]
    assert sender.config.join_timeout_s == 10.0  # no join_timeout_s: the group's timeout
    assert sender.connect() is None and sender.send(version=1)["syncs"] == 0
