"""Direct receive: single-tensor buckets land straight in the engine's parameter storage.

Sender -> real gloo `WeightSyncGroup` over loopback -> `WeightReceiver` -> `TorchEngine`, in
one process (one thread and event loop per engine). Checks the bytes land bitwise (tied and
untied aliases, bucket smaller than the largest tensor), that direct buckets bypass
``load_weights`` and keep the parameters' storage, and that an engine without the
``weight_views`` hook is still loaded through ``load_weights``.
"""

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.rollouter.engines.base import EngineError
from asyncrl.rollouter.engines.builtin.engine import TorchEngine
from asyncrl.sync.broadcast import BroadcastReceiver as WeightReceiver
from asyncrl.sync.broadcast import BroadcastSender as WeightSender

VERSIONS = (1, 2)




class _CountingEngine(TorchEngine):
    """TorchEngine that records the names given to ``load_weights``."""

    def __init__(self, *args, untie: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.loaded: list[str] = []
        if untie:  # lm_head gets its own storage: the alias must still be filled
            head = self.model.lm_head
            head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=False)
            self._params = dict(self.model.named_parameters(remove_duplicate=False))

    async def load_weights(self, named_tensors):
        named = list(named_tensors)
        self.loaded += [n for n, _ in named]
        await super().load_weights(named)


class _NoHookEngine:
    """An engine with the `RolloutEngine` weight methods but no ``weight_views`` (like vLLM)."""

    def __init__(self, inner: _CountingEngine):
        self.inner = inner
        self.model = inner.model

    def param_meta(self):
        return self.inner.param_meta()

    async def load_weights(self, named_tensors):
        await self.inner.load_weights(named_tensors)

    async def finish_weight_update(self, version):
        await self.inner.finish_weight_update(version)

    async def pause(self, mode="keep", clear_cache=False):
        await self.inner.pause(mode, clear_cache=clear_cache)

    async def resume(self):
        await self.inner.resume()

    async def close(self):
        await self.inner.close()


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _run(model_path, engines, bucket_mb):
    model = AutoModelForCausalLM.from_pretrained(model_path)
    group = dict(master_addr="127.0.0.1", world_size=1 + len(engines), timeout_s=20.0)
    sender = WeightSender(model, rank=0, bucket_mb=bucket_mb, **group)
    port = sender.connect()[0].group.master_port
    snaps = [{} for _ in engines]
    results = [[] for _ in engines]
    errors: list[BaseException] = []

    async def serve(i, engine):
        try:
            receiver = WeightReceiver(engine, rank_offset=1 + i, **group, master_port=port)
            await receiver.connect()
            for v in VERSIONS:
                await engine.pause("keep", clear_cache=False)
                results[i].append(await receiver.receive(version=v))
                await engine.resume()
                snaps[i][v] = _snapshot(engine.model)
            receiver.close()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)
        finally:
            await engine.close()

    threads = [threading.Thread(target=asyncio.run, args=(serve(i, e),), daemon=True) for i, e in enumerate(engines)]
    for t in threads:
        t.start()
    expected = {}
    try:
        for v in VERSIONS:
            g = torch.Generator().manual_seed(v)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g))
            expected[v] = _snapshot(model)
            sender.send(version=v)
    finally:
        for t in threads:
            t.join(60)
        sender.close()
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return expected, snaps, results


def _assert_bitwise(expected, snap):
    for v, params in expected.items():
        for name, t in params.items():
            assert torch.equal(snap[v][name], t), f"{name} differs at version {v}"
        assert torch.equal(snap[v]["lm_head.weight"], params["model.embed_tokens.weight"])


@pytest.mark.parametrize("bucket_mb", [0.001, 0.02], ids=["smaller-than-largest-tensor", "mid"])
def test_direct_receive_lands_bitwise_in_place_and_skips_load_weights(model_path, bucket_mb):
    tied = _CountingEngine(model_path)
    untied = _CountingEngine(model_path, untie=True)
    storage = {n: p.data_ptr() for n, p in tied.model.named_parameters()}
    expected, snaps, results = _run(model_path, [tied, untied], bucket_mb)
    for snap in snaps:
        _assert_bitwise(expected, snap)
    # direct buckets were written into the parameters themselves, never through load_weights
    assert {n: p.data_ptr() for n, p in tied.model.named_parameters()} == storage
    sender_model = AutoModelForCausalLM.from_pretrained(model_path)
    sizes = {n: p.nbytes for n, p in sender_model.named_parameters()}
    largest = max(sizes, key=sizes.get)
    for engine, res in zip((tied, untied), results):
        last = res[-1]
        assert last["direct_buckets"] > 0 and last["direct_bytes"] > 0
        assert largest not in engine.loaded  # the largest tensor always travels alone
        loaded_bytes = sum(sizes.get(n, 0) for n in engine.loaded) / len(VERSIONS)
        assert last["direct_bytes"] + loaded_bytes >= last["bytes"]
    # the tied engine's lm_head is the embedding; the untied one got it through load_weights
    assert "lm_head.weight" not in tied.loaded
    assert untied.loaded.count("lm_head.weight") == len(VERSIONS)


def test_engine_without_the_hook_is_loaded_through_load_weights(model_path):
    inner = _CountingEngine(model_path)
    expected, snaps, results = _run(model_path, [_NoHookEngine(inner)], bucket_mb=0.001)
    _assert_bitwise(expected, snaps[0])
    assert results[0][-1]["direct_buckets"] == 0
    sent = {n for n, _ in inner.model.named_parameters()}
    assert set(inner.loaded) == sent and len(inner.loaded) == len(sent) * len(VERSIONS)


async def test_weight_views_only_while_paused(model_path):
    engine = TorchEngine(model_path)
    try:
        with pytest.raises(EngineError, match="paused"):
            engine.weight_views()
        await engine.pause("keep")
        views = engine.weight_views()
        assert views["lm_head.weight"].data_ptr() == views["model.embed_tokens.weight"].data_ptr()
        assert all(v.data_ptr() == p.data_ptr() for v, p in zip(views.values(), engine._params.values()))
    finally:
        await engine.close()
