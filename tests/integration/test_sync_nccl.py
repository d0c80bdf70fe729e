"""The same weight-sync code on CUDA: backend ``auto`` picks nccl (needs 2 GPUs; skipped without).

Two real processes: trainer rank 0 on cuda:0 (`WeightSender`), one engine on cuda:1
(`TorchEngine` + `WeightReceiver`). Each prints a sha256 over its parameters' bytes after the
sync; they must match. Not run on the CPU machine this was written on (no GPU there).
"""

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

ROLE = r"""
import asyncio, hashlib, sys, torch
from transformers import AutoModelForCausalLM
from asyncrl.sync.broadcast import BroadcastSender as WeightSender
from asyncrl.sync.broadcast import BroadcastReceiver as WeightReceiver
from asyncrl.rollouter.engines.builtin.engine import TorchEngine

role, path, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
group = dict(master_addr="127.0.0.1", world_size=2, backend="auto", timeout_s=120.0)

def digest(model):
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()

if role == "trainer":
    torch.cuda.set_device(0)
    model = AutoModelForCausalLM.from_pretrained(path).cuda()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    sender = WeightSender(model, rank=0, bucket_mb=0.01, **{**group, "master_port": port})
    print("PORT", sender.connect()[0].group.master_port, flush=True)
    assert sender._wait_joined().backend == "nccl"
    sender.send(version=1)
    print("DIGEST", digest(model), flush=True)
    sender.close()
else:
    torch.cuda.set_device(1)
    async def main():
        engine = TorchEngine(path, device="cuda")
        receiver = WeightReceiver(engine, rank_offset=1, **{**group, "master_port": port})
        await receiver.connect()
        await engine.pause("keep", clear_cache=False)
        await receiver.receive(version=1)
        await engine.resume()
        print("DIGEST", digest(engine.model), flush=True)
        receiver.close()
        await engine.close()
    asyncio.run(main())
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (one per group rank)")
def test_nccl_sync_lands_bitwise(tmp_path):
    from asyncrl.models.tiny import build_tiny_model

    path = str(build_tiny_model(tmp_path / "m"))
    trainer = subprocess.Popen([sys.executable, "-c", ROLE, "trainer", path, "0"], stdout=subprocess.PIPE, text=True)
    engine = None
    try:
        line = trainer.stdout.readline()
        assert line.startswith("PORT"), line
        engine = subprocess.Popen([sys.executable, "-c", ROLE, "engine", path, line.split()[1]],
                                  stdout=subprocess.PIPE, text=True)
        out_e, _ = engine.communicate(timeout=240)
        out_t, _ = trainer.communicate(timeout=60)
        assert trainer.returncode == 0 and engine.returncode == 0
        digest = [ln for ln in out_t.splitlines() if ln.startswith("DIGEST")]
        assert digest and digest == [ln for ln in out_e.splitlines() if ln.startswith("DIGEST")]
    finally:
        for proc in (trainer, engine):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)
