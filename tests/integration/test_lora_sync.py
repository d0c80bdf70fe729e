"""Adapter-only weight sync: a peft LoRA model's adapters -> real gloo group -> `TorchEngine`.

One process (one thread and event loop for the engine), as in test_sync_direct. Checks that only
the adapters travel (bytes), and for both ways the built-in engine applies them:

- its lean forward keeps them unmerged: the engine's adapters equal the trainer's bitwise, its
  weights stay the base bitwise, and the log-probs it samples with equal the peft model's recompute;
- the Hugging Face forward (``decoder="hf"``) merges: the engine holds ``W_base + scale * B @ A``
  after each sync and the untouched weights bitwise, without drift (adapters set back to zero give
  the base weights back bitwise after several merges).
"""

import numpy as np

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.rollouter.engines.builtin.engine import TorchEngine
from asyncrl.sync.broadcast import BroadcastReceiver, BroadcastSender
from asyncrl.trainer import lora
from asyncrl.trainer.config import LoraConfig
from asyncrl.types import GenerateRequest, SamplingParams

PROMPT = np.arange(3, 11)


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
                snap = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
                dec = engine._runner.decoder
                if dec is not None and dec.lora is not None:
                    snap.update((n, t.clone()) for n, t in dec.lora.views.items())
                snap["@sample"] = await engine.generate(GenerateRequest(
                    f"s{v}", PROMPT, max_tokens=6, sampling=SamplingParams(temperature=1.0, seed=v)))
                snaps.append(snap)
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


def _recorder(expected, adapters):
    def record(update):
        def run(m):
            update(m)
            state = {n: p.detach().clone() for n, p in m.named_parameters()}
            expected.append(lora.merged_state_dict(state, lora.spec(m)))
            adapters.append({n: p.detach().clone() for n, p in lora.adapter_params(m).items()})
        return run
    return record


def _logprobs(model, result):
    ids = torch.as_tensor(np.concatenate([PROMPT, result.response_ids]))[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.as_tensor(result.response_ids)[:, None])[:, 0]


def _assert_sampled_from(model, result):
    """The engine's log-probs of what it sampled equal the trainer model's recompute."""
    torch.testing.assert_close(torch.as_tensor(result.logprobs), _logprobs(model, result), rtol=0, atol=1e-5)


@pytest.mark.parametrize("train_norms", [False, True], ids=["adapters", "adapters+norms"])
def test_only_adapters_travel_and_the_lean_forward_applies_them_unmerged(model_path, train_norms):
    model = _lora_model(model_path, target_modules=["q_proj", "v_proj", "down_proj"], train_norms=train_norms)
    base = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(model_path).named_parameters()}
    expected, adapters, results = [], [], []
    record = _recorder(expected, adapters)

    init, sent, snaps = _sync(model, TorchEngine(model_path), [record(_noise(1)), record(_noise(2)), record(_zero)])
    spec = init.options["lora"]
    assert sent == [sum(p.nbytes for p in lora.adapter_params(model).values())] * 3
    for snap, want, merged in zip(snaps, adapters, expected):
        for name, t in want.items():  # peft's "...q_proj.lora_A.default.weight" -> the wire's "...q_proj.lora_A"
            wire = name.removeprefix("base_model.model.").replace(".default.weight", "")
            assert torch.equal(snap[wire], t), wire
        for name, t in base.items():
            assert torch.equal(snap[name], merged[name] if name in spec["full"] else t), name
    # the zero adapters of the last sync: the engine samples from the base exactly as the trainer does
    _assert_sampled_from(model, snaps[2]["@sample"])


def test_sampled_log_probs_equal_the_trainer_s_under_live_adapters(model_path):
    """One sync of non-zero adapters, then the trainer's recompute of what the engine sampled."""
    for decoder in ("auto", "hf"):
        model = _lora_model(model_path)
        _, _, snaps = _sync(model, TorchEngine(model_path, decoder=decoder), [_noise(3)])
        _assert_sampled_from(model, snaps[0]["@sample"])
        plain = AutoModelForCausalLM.from_pretrained(model_path)  # the adapters moved the policy
        assert (_logprobs(plain, snaps[0]["@sample"]) - torch.as_tensor(snaps[0]["@sample"].logprobs)).abs().max() > 1e-3


@pytest.mark.parametrize("train_norms", [False, True], ids=["adapters", "adapters+norms"])
def test_the_hf_forward_merges_them_exactly_without_drift(model_path, train_norms):
    model = _lora_model(model_path, target_modules=["q_proj", "v_proj", "down_proj"], train_norms=train_norms)
    base = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(model_path).named_parameters()}
    expected = []
    record = _recorder(expected, [])

    init, sent, snaps = _sync(model, TorchEngine(model_path, decoder="hf"),
                              [record(_noise(1)), record(_noise(2)), record(_zero)])
    spec = init.options["lora"]
    assert spec["rank"] == 4 and spec["scale"] == 2.0 and len(spec["modules"]) == 2 * 3  # 2 layers x 3 targets
    assert len(spec["full"]) == (2 * 2 + 1 if train_norms else 0)  # 2 norms per layer + the final one
    adapter_bytes = sum(p.nbytes for p in lora.adapter_params(model).values())
    assert sent == [adapter_bytes] * 3
    assert adapter_bytes * 10 < sum(p.nbytes for p in base.values())
    adapted = {f"{m}.weight" for m in spec["modules"]} | set(spec["full"])
    for snap, want in zip(snaps[:2], expected[:2]):
        for name, t in snap.items():
            if name == "@sample":
                continue
            if name in adapted:
                torch.testing.assert_close(t, want[name], rtol=0, atol=1e-6)
                assert not torch.equal(t, base[name])
            else:
                assert torch.equal(t, base[name]), name
    # zero adapters after two merges: the base comes back bitwise (each sync merges onto the kept base)
    for name, t in snaps[2].items():
        if name != "@sample":
            assert torch.equal(t, base[name] if name not in spec["full"] else expected[2][name]), name


def test_default_targets_are_every_linear_layer_of_the_blocks_and_bad_names_are_refused(model_path):
    assert lora.check_targets(str(model_path), LoraConfig(rank=2)) == [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with pytest.raises(ValueError, match=r"'qkv' is not a linear layer.*q_proj"):
        lora.check_targets(str(model_path), LoraConfig(rank=2, target_modules=["q_proj", "qkv"]))
    with pytest.raises(ValueError, match="rank must be >= 0"):
        LoraConfig(rank=-1)
