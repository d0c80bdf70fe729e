"""A trainer rank sorts its rows by length before cutting micro-batches (less padding computed):
the loss and the gradient norm it reports equal one plain forward and backward of the whole
batch in its original order, so every field stayed with its row."""

import math

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from asyncrl.models.tiny import build_tiny_model
from asyncrl.net import free_port
from asyncrl.trainer import algorithm
from asyncrl.trainer.config import AlgorithmConfig, OptimConfig, WorkerConfig
from asyncrl.trainer.worker import TrainerWorker


def _batch(vocab: int, rows: int = 12, width: int = 20, prompt: int = 4) -> TensorDict:
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(prompt + 1, width + 1, (rows,), generator=g)
    lengths[3] = width  # the longest row is neither first nor last
    attention = (torch.arange(width)[None] < lengths[:, None]).long()
    response = attention.clone()
    response[:, :prompt] = 0
    ids = torch.randint(3, vocab, (rows, width), generator=g) * attention
    advantages = torch.randn(rows, 1, generator=g).expand(rows, width) * response
    return TensorDict({
        "input_ids": ids, "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        "old_logprobs": (-0.5 - torch.rand(rows, width, generator=g)) * response,
        "advantages": advantages.contiguous(), "response_mask": response,
    }, batch_size=[rows])


@pytest.mark.timeout(120)
def test_sorted_micro_batches_report_the_loss_and_gradient_norm_of_the_whole_unsorted_batch(tmp_path):
    path = str(build_tiny_model(tmp_path / "model", seed=1))
    # Decoupled + KL: the proximal and reference forwards run over the same sorted micro-batches.
    algo = AlgorithmConfig(decoupled=True, kl_coef=0.1, tis_cap=2.0)
    cfg = WorkerConfig(model_path=path, micro_batch_size=5, device="cpu", algorithm=algo,
                       optim=OptimConfig(lr=1e-3, grad_clip=0.0))
    worker = TrainerWorker(cfg, rank=0, world_size=1, master_port=free_port())
    try:
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        batch = _batch(reference.config.vocab_size)
        denom = float(batch["response_mask"].sum())
        assert not torch.equal(batch["attention_mask"].sum(-1).sort(descending=True).values,
                               batch["attention_mask"].sum(-1))  # the rank has rows to reorder

        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"], use_cache=False).logits
        logprobs = algorithm.token_logprobs(logits, batch["input_ids"], algo.temperature)
        loss, _ = algorithm.policy_loss(logprobs, batch["old_logprobs"], batch["advantages"], batch["response_mask"],
                                        algo, denom=denom, proximal_logprobs=logprobs.detach(),
                                        ref_logprobs=logprobs.detach())
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in reference.parameters() if p.grad is not None))

        out = worker.train_minibatch(batch, denom)
        assert out["loss"] == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-7)
        assert out["grad_norm"] == pytest.approx(norm, rel=1e-4)
    finally:
        worker.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
