"""Sender -> gloo group -> receivers -> TorchEngine, in one process (threads, one event loop each).

The group is a real `WeightSyncGroup` (gloo over loopback) built beside no default group;
the engines are real `TorchEngine`s over the tiny model (tied embeddings).
"""

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.models.tiny import build_tiny_model
from asyncrl.rollouter.engines.builtin.engine import TorchEngine
from asyncrl.sync.broadcast import BroadcastReceiver as WeightReceiver
from asyncrl.sync.broadcast import BroadcastSender as WeightSender
from asyncrl.sync.wire import WeightSyncError

N_ENGINES = 2




def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))


class _EngineThread(threading.Thread):
    """One engine + receiver on its own event loop; runs ``versions`` receives, records params."""

    def __init__(self, model_path, rank, group, versions):
        super().__init__(daemon=True)
        # built here: transformers' loading is not thread-safe, the event loop binds lazily
        self.engine = TorchEngine(model_path)
        self.model_path, self.rank, self.group, self.versions = model_path, rank, group, versions
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.results: list[dict] = []
        self.error: BaseException | None = None

    def run(self):
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc

    async def _main(self):
        engine = self.engine
        try:
            receiver = WeightReceiver(engine, rank_offset=self.rank, **self.group)
            await receiver.connect()
            for v in self.versions:
                await engine.pause("keep", clear_cache=False)
                self.results.append(await receiver.receive(version=v))
                await engine.resume()
                self.snapshots[v] = {n: p.detach().clone() for n, p in engine.model.named_parameters(remove_duplicate=False)}
            receiver.close()
        finally:
            await engine.close()


def _run_syncs(model_path, bucket_mb, versions=(1, 2, 3)):
    model = AutoModelForCausalLM.from_pretrained(model_path)
    group = dict(master_addr="127.0.0.1", world_size=1 + N_ENGINES, timeout_s=20.0)
    sender = WeightSender(model, rank=0, bucket_mb=bucket_mb, **group)
    port = sender.connect()[0].group.master_port
    engines = [_EngineThread(model_path, 1 + i, {**group, "master_port": port}, versions) for i in range(N_ENGINES)]
    for e in engines:
        e.start()
    expected, stats = {}, []
    try:
        for v in versions:
            _perturb(model, seed=v)
            expected[v] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
            stats.append(sender.send(version=v))
    except WeightSyncError:
        errors = [e.error for e in engines if e.error is not None]
        if errors:
            raise errors[0]
        raise
    finally:
        for e in engines:
            e.join(60)
        sender.close()
    for e in engines:
        assert not e.is_alive()
        if e.error is not None:
            raise e.error
    return engines, expected, stats


@pytest.mark.parametrize("bucket_mb", [0.001, 0.02, 100.0], ids=["smaller-than-largest-tensor", "mid", "larger-than-model"])
def test_every_sync_lands_bitwise_and_metadata_goes_once(model_path, bucket_mb):
    engines, expected, stats = _run_syncs(model_path, bucket_mb)
    for e in engines:
        for v, params in expected.items():
            got = e.snapshots[v]
            assert set(got) == set(params)
            for name, t in params.items():
                assert torch.equal(got[name], t), f"engine rank {e.rank} {name} differs at version {v}"
        # tied: lm_head is the embedding, and it was updated through the single sent tensor
        assert torch.equal(e.snapshots[3]["lm_head.weight"], expected[3]["model.embed_tokens.weight"])
        assert [r["version"] for r in e.results] == [1, 2, 3]
        assert [r["meta"] for r in e.results] == [True, False, False]
        assert e.results[-1]["meta_received"] == 1
    assert stats[-1]["meta_sends"] == 1 and stats[-1]["syncs"] == 3
    n_buckets = stats[-1]["buckets"]
    if bucket_mb >= 100:
        assert n_buckets == 1
    else:
        largest = max(p.nbytes for p in expected[1].values())
        assert largest > bucket_mb * 2**20 and n_buckets > 3


def test_mismatched_engine_model_is_refused_by_name(model_path, tmp_path):
    other = build_tiny_model(tmp_path / "wide", seed=0, intermediate_size=96)
    model = AutoModelForCausalLM.from_pretrained(other)
    group = dict(master_addr="127.0.0.1", world_size=2, timeout_s=30.0)
    sender = WeightSender(model, rank=0, bucket_mb=1.0, **group)
    port = sender.connect()[0].group.master_port
    engine = _EngineThread(model_path, 1, {**group, "master_port": port}, versions=(1,))
    engine.start()
    with pytest.raises(WeightSyncError, match="version 1"):
        sender.send(version=1)
    engine.join(60)
    sender.close()
    assert not engine.is_alive()
    assert isinstance(engine.error, WeightSyncError)
    assert "mlp.gate_proj.weight has shape [192, 64] in the engine, [96, 64] from the trainer" in str(engine.error)


def test_rank0_close_does_not_wait_for_engines_that_never_join():
    sender = WeightSender(torch.nn.Linear(2, 2), rank=0, world_size=2, master_addr="auto", timeout_s=30.0)
    (init,) = sender.connect()  # one ReceiverInit per engine
    assert init.method == "broadcast" and init.rank_offset == 1
    assert init.group.master_addr == "127.0.0.1" and init.group.master_port > 0  # "auto" without Ray: loopback
    sender.close()  # returns at once although no engine joined
    with pytest.raises(WeightSyncError, match="not connected"):
        sender.send(version=1)
