"""Adapter-only weight sync: a peft LoRA model's adapters -> real gloo group -> `TorchEngine`.

One process (one thread and event loop for the engine), as in test_sync_direct. Checks that only
the adapters travel (bytes), that the engine holds ``W_base + scale * B @ A`` after each sync and
the untouched weights bitwise, and that it does not drift: adapters set back to zero give the
base weights back bitwise after several merges.
"""

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.rollouter.engines.builtin.engine import TorchEngine
from asyncrl.sync.broadcast import BroadcastReceiver, BroadcastSender
from asyncrl.trainer import lora
from asyncrl.trainer.config import LoraConfig


def _lora_model(model_path, **kw):
    return lora.wrap(AutoModelForCausalLM.from_pretrained(model_path), LoraConfig(rank=4, alpha=8, **kw))


def _sync(model, engine, updates):
    """Send once per ``updates`` entry (a function changing the adapters); engine snapshots per sync."""
    group = {"master_addr": "127.0.0.1", "world_size": 2, "timeout_s": 20.0}
    sender = BroadcastSender(model, rank=0, bucket_mb=0.01, **group)
    init = sender.connect()[0]
    snaps, errors = [], []

    async def serve():
        try:
            receiver = BroadcastReceiver(engine, rank_offset=1, **group, master_port=init.group.master_port,
                                         **init.options)
            await receiver.connect()
            for v in range(1, len(updates) + 1):
                await engine.pause("keep", clear_cache=False)
                await receiver.receive(version=v)
                await engine.resume()
                snaps.append({n: p.detach().clone() for n, p in engine.model.named_parameters()})
            receiver.close()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)
        finally:
            await engine.close()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    sent = []
    try:
        for v, update in enumerate(updates, 1):
            with torch.no_grad():
                update(model)
            sent.append(sender.send(version=v)["bytes"])
    finally:
        thread.join(60)
        sender.close()
    if errors:
        raise errors[0]
    return init, sent, snaps


def _noise(seed):
    def update(model):
        g = torch.Generator().manual_seed(seed)
        for p in lora.adapter_params(model).values():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return update


def _zero(model):
    for p in lora.adapter_params(model).values():
        p.zero_()


@pytest.mark.parametrize("train_norms", [False, True], ids=["adapters", "adapters+norms"])
def test_only_adapters_travel_and_the_engine_merges_them_exactly_without_drift(model_path, train_norms):
    model = _lora_model(model_path, target_modules=["q_proj", "v_proj", "down_proj"], train_norms=train_norms)
    base = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(model_path).named_parameters()}
    expected = []

    def record(update):
        def run(m):
            update(m)
            state = {n: p.detach().clone() for n, p in m.named_parameters()}
            expected.append(lora.merged_state_dict(state, lora.spec(m)))
        return run

    init, sent, snaps = _sync(model, TorchEngine(model_path), [record(_noise(1)), record(_noise(2)), record(_zero)])
    spec = init.options["lora"]
    assert spec["rank"] == 4 and spec["scale"] == 2.0 and len(spec["modules"]) == 2 * 3  # 2 layers x 3 targets
    assert len(spec["full"]) == (2 * 2 + 1 if train_norms else 0)  # 2 norms per layer + the final one
    adapter_bytes = sum(p.nbytes for p in lora.adapter_params(model).values())
    assert sent == [adapter_bytes] * 3
    assert adapter_bytes * 10 < sum(p.nbytes for p in base.values())
    adapted = {f"{m}.weight" for m in spec["modules"]} | set(spec["full"])
    for snap, want in zip(snaps[:2], expected[:2]):
        for name, t in snap.items():
            if name in adapted:
                torch.testing.assert_close(t, want[name], rtol=0, atol=1e-6)
                assert not torch.equal(t, base[name])
            else:
                assert torch.equal(t, base[name]), name
    # zero adapters after two merges: the base comes back bitwise (each sync merges onto the kept base)
    for name, t in snaps[2].items():
        assert torch.equal(t, base[name] if name not in spec["full"] else expected[2][name]), name


def test_default_targets_are_every_linear_layer_of_the_blocks_and_bad_names_are_refused(model_path):
    assert lora.check_targets(str(model_path), LoraConfig(rank=2)) == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with pytest.raises(ValueError, match=r"'qkv' is not a linear layer.*q_proj"):
        lora.check_targets(str(model_path), LoraConfig(rank=2, target_modules=["q_proj", "qkv"]))
    with pytest.raises(ValueError, match="rank must be >= 0"):
        LoraConfig(rank=-1)
