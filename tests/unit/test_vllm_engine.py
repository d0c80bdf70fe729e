"""vLLM engine and vLLM's NCCL weight-transfer sender: the parts that need no vLLM process.

CPU tests (no vLLM import): request translation, finish reasons, logprob/version extraction,
checkpoint metadata, engine arguments, vLLM's packed-bucket geometry and bytes (against vLLM's own
packer in ``tests/integration/test_vllm_real.py``), the sender's metadata; the NCCL path's failure handling against a stand-in ``AsyncLLM`` (NCCL cannot run
here). GPU tests (``gpu`` marker, and skipped without vLLM): with two GPUs, a real NCCL weight
transfer from this process into a real engine. The engine itself, against a real vLLM (its
CPU build here, any build elsewhere), is tested in ``tests/integration/test_vllm_real.py``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncrl.models.tiny import build_tiny_model
from asyncrl.rollouter.engines.base import EngineError
from asyncrl.rollouter.engines.vllm.config import VLLMEngineConfig, model_eos_token_ids, sampling_kwargs
from asyncrl.rollouter.engines.vllm.engine import expand_version_spans, map_finish_reason, sampled_logprobs
from asyncrl.sync.vllm_broadcast import checkpoint_param_meta
from asyncrl.sync.base import GroupInit, SenderInit
from asyncrl.sync.vllm import (
    TensorMeta,
    VLLMSyncConfig,
    VLLMWeightSyncError,
    VLLMWeightSender,
    broadcast_packed,
    check_vllm_alignment,
    engine_init_infos,
    plan_vllm_buckets,
    update_info,
)
from asyncrl.types import GenerateRequest, SamplingParams

CPU = torch.device("cpu")


def _request(**sampling) -> GenerateRequest:
    return GenerateRequest("r0", np.array([1, 5, 6]), max_tokens=7, sampling=SamplingParams(**sampling))


# ----------------------------------------------------------------------- engine, pure logic


def test_modules_import_without_vllm():
    code = "import sys, asyncrl.rollouter.engines.vllm, asyncrl.sync.vllm; assert 'vllm' not in sys.modules"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_sampling_kwargs_greedy_and_sampled():
    greedy = sampling_kwargs(_request(greedy=True, temperature=0.7, top_k=5, stop_token_ids=(9,)), eos_token_ids=(2,))
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 0 and greedy["top_p"] == 1.0
    assert greedy["stop_token_ids"] == [2, 9]
    assert greedy["max_tokens"] == 7 and greedy["n"] == 1
    # the sampled token's logprob only, ids only, and no EOS but the ones we pass
    assert greedy["logprobs"] == 0 and greedy["detokenize"] is False and greedy["ignore_eos"] is True

    sampled = sampling_kwargs(_request(temperature=0.7, top_p=0.9, top_k=5, seed=3, stop_token_ids=(2, 4)), (2,))
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"], sampled["seed"]) == (0.7, 0.9, 5, 3)
    assert sampled["stop_token_ids"] == [2, 4]  # EOS given twice is listed once


def test_finish_reason_mapping():
    assert [map_finish_reason("r", x) for x in ("stop", "length", "abort")] == ["stop", "length", "abort"]
    for bad in ("error", "repetition", None):
        with pytest.raises(EngineError, match="request r7"):
            map_finish_reason("r7", bad)


def test_sampled_logprobs_picks_the_sampled_token():
    lp = SimpleNamespace
    positions = [{4: lp(logprob=-0.5), 7: lp(logprob=-0.1)}, {9: lp(logprob=-2.0)}]
    np.testing.assert_array_equal(sampled_logprobs("r", [4, 9], positions), np.array([-0.5, -2.0], np.float32))
    assert sampled_logprobs("r", [], None).shape == (0,)
    with pytest.raises(EngineError, match="no logprob for sampled token 5"):
        sampled_logprobs("r", [4, 5], positions)
    with pytest.raises(EngineError, match="3 tokens but 2"):
        sampled_logprobs("r", [4, 9, 1], positions)
    with pytest.raises(EngineError, match="no logprobs"):
        sampled_logprobs("r", [4], None)


def test_version_spans_expand_per_token():
    span = lambda v, a, b: SimpleNamespace(version=v, start=a, end=b)  # noqa: E731
    got = expand_version_spans([span("default", 0, 3), span("1", 3, 5), span("2", 5, 6)], 6, initial_version=0)
    np.testing.assert_array_equal(got, [0, 0, 0, 1, 1, 2])
    assert expand_version_spans(None, 0, 0).shape == (0,)
    with pytest.raises(EngineError, match="do not cover"):
        expand_version_spans([span("1", 0, 2)], 4, 0)
    with pytest.raises(EngineError, match="not an integer"):
        expand_version_spans([span("v1", 0, 2)], 2, 0)
    with pytest.raises(EngineError, match="without weight-version spans"):
        expand_version_spans(None, 3, 0)


def test_checkpoint_meta_matches_the_hf_model(tmp_path):
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "m")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected = sorted((n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters())
    assert checkpoint_param_meta(path) == expected  # tied lm_head is stored once, as HF names it
    assert model_eos_token_ids(path) == (model.config.eos_token_id,)


def test_engine_config_validates_and_builds_engine_args(tmp_path):
    (tmp_path / "config.json").write_text('{"dtype": "float32"}')
    cfg = VLLMEngineConfig(model_path=tmp_path, dtype="float32", max_model_len=128, engine_kwargs={"max_num_batched_tokens": 512})
    args = cfg.engine_args()
    assert args["model"] == str(tmp_path) and args["logprobs_mode"] == "processed_logprobs"
    assert "weight_transfer_config" not in args and args["skip_tokenizer_init"] is True
    assert args["worker_extension_cls"] == "asyncrl.sync.vllm_broadcast.AsyncrlWorkerExtension"
    assert args["max_model_len"] == 128 and args["max_num_batched_tokens"] == 512
    assert VLLMEngineConfig(model_path=tmp_path, dtype=torch.bfloat16).engine_args()["dtype"] == "bfloat16"
    nccl = VLLMEngineConfig(model_path=tmp_path, weight_transfer="nccl").engine_args()
    assert nccl["weight_transfer_config"] == {"backend": "nccl"}
    # CPU defaults: eager, a bounded KV cache; GPU: vLLM's own sizing
    assert cfg.engine_args(cpu=True)["enforce_eager"] is True and args["enforce_eager"] is False
    assert cfg.engine_args(cpu=True)["kv_cache_memory_bytes"] == 1024 * 2**20 and "kv_cache_memory_bytes" not in args
    with pytest.raises(ValueError, match="weight_transfer"):
        VLLMEngineConfig(model_path=tmp_path, weight_transfer="gloo")


def test_auto_dtype_is_the_checkpoints_own(tmp_path):
    # vLLM's own "auto" serves an fp32 checkpoint in 16 bits on CPU; asyncrl asks for what the file holds
    (tmp_path / "config.json").write_text('{"dtype": "float32"}')
    assert VLLMEngineConfig(model_path=tmp_path).engine_args()["dtype"] == "float32"
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert VLLMEngineConfig(model_path=tmp_path).engine_args()["dtype"] == "bfloat16"
    (tmp_path / "config.json").write_text('{}')
    assert VLLMEngineConfig(model_path=tmp_path).engine_args()["dtype"] == "float32"
    with pytest.raises(ValueError, match="logprobs_mode"):
        VLLMEngineConfig(model_path=tmp_path, logprobs_mode="sampled")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMEngineConfig(model_path=tmp_path, gpu_memory_utilization=0)
    with pytest.raises(ValueError, match="engine_kwargs must not set"):
        VLLMEngineConfig(model_path=tmp_path, engine_kwargs={"logprobs_mode": "raw_logprobs"})


# ----------------------------------------------------------------------- sender, pure logic


def test_bucket_plan_is_vllms_greedy_overflow_rule():
    # a bucket closes right after the tensor that takes it PAST the threshold (strictly greater)
    assert plan_vllm_buckets([4, 4, 4], 5) == [range(0, 2), range(2, 3)]
    assert plan_vllm_buckets([5, 5], 10) == [range(0, 2)]
    assert plan_vllm_buckets([5, 5, 1], 10) == [range(0, 3)]
    assert plan_vllm_buckets([100, 1, 100], 10) == [range(0, 1), range(1, 3)]  # tensors larger than a bucket
    assert plan_vllm_buckets([3, 3, 3], 10**9) == [range(0, 3)]  # bucket larger than the model
    assert plan_vllm_buckets([], 10) == []


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("embed", torch.randn(16, 8, generator=g)),
        ("norm", torch.randn(8, generator=g).to(torch.bfloat16)),
        ("count", torch.randint(0, 9, (4, 4), generator=g)),
        ("big", torch.randn(64, 64, generator=g)),
        ("half", torch.randn(6, generator=g).half()),
        ("scalar", torch.randn((), generator=g)),
    ]


@pytest.mark.parametrize("bucket_bytes", [1, 100, 600, 16384, 10**9])
def test_packed_buckets_carry_exact_bytes_in_vllm_geometry(bucket_bytes):
    tensors = _tensors()
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    sent = []
    total, peak = broadcast_packed(
        iter(tensors), metas, bucket_bytes=bucket_bytes, broadcast=lambda buf, s: sent.append(buf.clone()),
        device=CPU, streams=[None, None],
    )
    plan = plan_vllm_buckets([m.nbytes for m in metas], bucket_bytes)
    assert [b.numel() for b in sent] == [sum(metas[i].nbytes for i in idx) for idx in plan]
    assert total == sum(m.nbytes for m in metas)
    assert peak <= 2 * max(b.numel() for b in sent)  # two slots held at most
    # unpack the way vLLM's receiver does: rebuild (shape, dtype) from update_info, split by size
    info = update_info(metas)
    got = {}
    for idx, buf in zip(plan, sent):
        sizes = [metas[i].nbytes for i in idx]
        for i, piece in zip(idx, buf.split(sizes)):
            got[info["names"][i]] = piece.view(getattr(torch, info["dtype_names"][i])).view(info["shapes"][i])
    for name, t in tensors:
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_source_that_disagrees_with_metadata_is_refused():
    tensors = _tensors()
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    send = lambda pairs: broadcast_packed(  # noqa: E731
        iter(pairs), metas, bucket_bytes=10**9, broadcast=lambda b, s: None, device=CPU, streams=[None]
    )
    with pytest.raises(ValueError, match="index 1: declared 'norm'"):
        send([tensors[0], ("other", tensors[1][1]), *tensors[2:]])
    with pytest.raises(ValueError, match="ended after 5 tensors"):
        send(tensors[:5])
    with pytest.raises(ValueError, match="beyond the 6 tensors"):
        send([*tensors, ("extra", torch.zeros(1))])


def test_alignment_check_flags_what_vllms_receiver_cannot_view():
    # 7 bf16 values (14 bytes) then an int64: vLLM's split(...).view(int64) fails at offset 14
    metas = [TensorMeta("a", torch.bfloat16, (7,)), TensorMeta("b", torch.int64, (2,))]
    with pytest.raises(ValueError, match="'b'.*byte 14"):
        check_vllm_alignment(metas, 10**9)
    check_vllm_alignment(metas, 1)  # one tensor per bucket: every offset is 0


def test_engine_init_infos_lay_engines_out_after_trainer_rank0():
    infos = engine_init_infos(master_address="10.0.0.1", master_port=29555, workers_per_engine=[1, 2, 1], bucket_bytes=64)
    assert [i["rank_offset"] for i in infos] == [1, 2, 4]
    assert {i["world_size"] for i in infos} == {5}
    # exactly the fields of vLLM 0.33's NCCLWeightTransferInitInfo that the TCP rendezvous uses
    assert set(infos[0]) == {
        "master_address", "master_port", "rank_offset", "world_size",
        "packed", "packed_buffer_size_bytes", "packed_num_buffers",
    }  # fmt: skip
    assert infos[0]["packed_buffer_size_bytes"] == 64 and infos[0]["packed_num_buffers"] == 2
    with pytest.raises(ValueError, match="workers_per_engine"):
        engine_init_infos(master_address="x", master_port=1, workers_per_engine=[])


def test_sender_announces_metadata_every_sync_and_broadcasts_all_bytes(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m"), dtype=torch.float32)
    sender = VLLMWeightSender(model, rank=0, workers_per_engine=[1, 1], config=VLLMSyncConfig(bucket_mb=0.01))
    received = []
    # Stand-in for the NCCL communicator (no CUDA here): record what rank 0 broadcasts.
    sender._comm = SimpleNamespace(broadcast=lambda buf, src, stream: received.append(buf.clone()))
    sender.device, sender._streams = CPU, [None, None]

    first = sender.update_kwargs(version=1)
    names = [n for n, _ in model.named_parameters()]
    assert first["names"] == names and set(first["dtype_names"]) == {"float32"}
    stats = sender.send(version=1)
    assert stats["bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert len(received) == len(plan_vllm_buckets([m.nbytes for m in sender.metas()], sender.config.bucket_bytes)) > 1
    flat = torch.cat(received)
    expected = torch.cat([p.detach().reshape(-1).view(torch.uint8) for p in model.parameters()])
    assert torch.equal(flat, expected)

    # full metadata every sync: vLLM 0.32 does not read empty lists as "same as last time"
    assert sender.update_kwargs(version=2) == first


def test_sender_on_other_ranks_only_iterates(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m"), dtype=torch.float32)
    sender = VLLMWeightSender(model, rank=1, workers_per_engine=[1])
    assert sender.connect() is None
    assert sender.send(version=1)["syncs"] == 0  # no communicator needed, nothing broadcast
    with pytest.raises(ValueError, match="workers_per_engine"):
        VLLMWeightSender(model, rank=0, workers_per_engine=[0])
    # what asyncrl.sync.coordinator passes a trainer rank's init_weight_sync
    init = SenderInit(method="vllm", bucket_mb=8.0, workers_per_engine=2,
                      group=GroupInit(master_addr="127.0.0.1", world_size=5, timeout_s=30.0, join_timeout_s=20.0))
    built = VLLMWeightSender.from_init(model, rank=0, init=init)
    assert built.workers_per_engine == [2, 2] and built.world_size == 5 and built.config.bucket_bytes == 8 * 2**20
    assert built.config.join_timeout_s == 20.0
    with pytest.raises(ValueError, match="world_size=4"):
        VLLMWeightSender.from_init(model, rank=0, init=SenderInit(method="vllm", workers_per_engine=2,
                                                                  group=GroupInit(world_size=4)))


# ----------------------------------------------------------------------- GPU: a real AsyncLLM

gpu = pytest.mark.gpu


def _gpu_model(path, seed=0):
    # head_dim 64 (vLLM's attention kernels want a multiple of 8; 64 is supported everywhere)
    return build_tiny_model(path, seed=seed, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=256)  # fmt: skip


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory):
    return _gpu_model(tmp_path_factory.mktemp("vllm") / "tiny")


def _engine(path, **kw):
    pytest.importorskip("vllm")
    from asyncrl.rollouter.engines.vllm import VLLMEngine

    return VLLMEngine(path, dtype="float32", gpu_memory_utilization=0.15, enforce_eager=True, max_model_len=256, **kw)


def _hf(path, device="cuda"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


def _hf_greedy(model, prompt, n):
    # argmax of a full forward, token by token: no generate() EOS/config semantics involved
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def _hf_logprobs(model, prompt, response):
    ids = torch.tensor([prompt + response], device=model.device)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1, device=model.device)
    return logp[pos, torch.tensor(response, device=model.device)].cpu().numpy()


def _greedy(rid, prompt, n):
    return GenerateRequest(rid, np.array(prompt), max_tokens=n, sampling=SamplingParams(greedy=True))


PROMPTS = [[1, 10, 11, 12], [1, 20, 21, 22, 23, 24, 25, 26, 27], [1, 30]]


@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
async def test_vllm_nccl_weight_transfer_into_kept_request(tmp_path, gpu_model_dir):
    # vLLM's worker takes GPU 0; the trainer (this process) broadcasts from GPU 1.
    pytest.importorskip("vllm")
    new_dir = _gpu_model(tmp_path / "new", seed=1)
    engine = _engine(gpu_model_dir, eos_token_ids=(), weight_transfer="nccl")  # vLLM's own NCCL engine
    torch.cuda.set_device(1)
    trainer = _hf(new_dir, device="cuda:1")
    sender = VLLMWeightSender(trainer, rank=0, workers_per_engine=[1], config=VLLMSyncConfig(bucket_mb=0.05))
    try:
        from asyncrl.sync.backends import make_receiver

        (init,) = sender.connect()
        receiver = make_receiver(engine, init, engine_kind="vllm")
        await receiver.connect()

        task = asyncio.create_task(engine.generate(_greedy("k", PROMPTS[1], 100)))

        await asyncio.sleep(0)  # let generate() register the request
        before = await engine.wait_for_tokens("k", 10)
        await engine.pause("keep", clear_cache=False)
        kw = sender.update_kwargs(version=1)
        sent = {}
        thread = threading.Thread(target=lambda: sent.update(sender.send(version=1)))
        thread.start()
        await receiver.receive(version=1, **kw)
        thread.join(120)
        assert sent["bytes"] == sum(p.numel() * p.element_size() for p in trainer.parameters())
        await engine.resume()
        kept = await task
        assert engine.version == 1
        v = kept.versions
        assert (v[:before] == 0).all() and v[-1] == 1 and (np.diff(v) >= 0).all()

        # after the sync the engine generates exactly what the new weights generate
        res = await engine.generate(_greedy("n", PROMPTS[0], 24))
        assert res.response_ids.tolist() == _hf_greedy(_hf(new_dir), PROMPTS[0], 24)
        assert (res.versions == 1).all()
    finally:
        sender.close()
        await engine.close()


# ----------------------------------------------------------------------- glue, on a stand-in AsyncLLM
#
# The failure handling of vLLM's NCCL transfer path (``weight_sync.method=vllm``) needs CUDA on
# both sides, so these run VLLMEngine's and VLLMWeightReceiver's own code against a small
# stand-in for ``AsyncLLM`` (the engine itself runs against vLLM's CPU build in
# tests/integration/test_vllm_real.py). It follows vLLM 0.33's contract as read from its source
# (``vllm.__version__`` 0.33.0; a test sets 0.32.0 to run 0.32's branch): DELTA outputs
# (new token ids + their logprobs per step), a final output with finish_reason and
# ``weight_versions`` spans, pause keep/abort/wait, abort(ids), the weight-update calls, and
# the engine's weight-version label ("default" until finish_weight_update sets one).


class _FakeAsyncLLM:
    def __init__(self, engine_args, stat_loggers=()):
        self.engine_args = engine_args
        self.label = "default"
        self.paused: str | None = None
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.aborted: set[str] = set()
        self.calls: list = []
        self.prompts: list[dict] = []
        self.model_config = SimpleNamespace(dtype=torch.bfloat16)
        self.init_blocks = False  # True: init_weight_transfer_engine never returns (a peer never joined)

    async def generate(self, prompt, params, request_id):
        self.prompts.append(dict(prompt))
        if self.paused in ("abort", "wait"):
            raise _FakeRetryable("Generation is paused. Please retry after it resumes.")
        ids, spans = list(prompt["prompt_token_ids"]), []
        n = 0
        while True:
            await self.resumed.wait()
            await asyncio.sleep(0)
            if request_id in self.aborted or self.paused == "abort":
                yield _out([], [], "abort", spans)
                return
            tok = (ids[-1] * 7 + 3) % 50
            ids.append(tok)
            if not spans or spans[-1].version != self.label:
                spans.append(SimpleNamespace(version=self.label, start=n, end=n))
            n += 1
            spans[-1].end = n
            done = "stop" if tok in params.kw["stop_token_ids"] else "length" if n >= params.kw["max_tokens"] else None
            yield _out([tok], [{tok: SimpleNamespace(logprob=-tok / 100)}], done, spans if done else None)
            if done:
                return

    async def pause_generation(self, *, mode, clear_cache):
        self.calls.append(("pause", mode, clear_cache))
        self.paused = mode
        if mode == "keep":
            self.resumed.clear()

    async def resume_generation(self):
        self.calls.append(("resume",))
        self.paused = None
        self.resumed.set()

    async def abort(self, request_ids):
        self.calls.append(("abort", sorted(request_ids)))
        self.aborted.update(request_ids)

    async def init_weight_transfer_engine(self, request):
        self.calls.append(("init", request.init_info))
        if self.init_blocks:
            await asyncio.Event().wait()

    async def start_weight_update(self):
        self.calls.append(("start",))

    async def update_weights(self, request):
        self.calls.append(("update", request.update_info))
        if request.update_info.get("names") == ["boom"]:
            raise RuntimeError("NCCL error: remote peer died")

    async def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))

    async def update_weight_version(self, weight_version):
        self.calls.append(("label", weight_version))
        self.label = weight_version

    def shutdown(self):
        self.calls.append(("shutdown",))


class _FakeRetryable(Exception):
    pass


def _out(token_ids, logprobs, finish, spans):
    return SimpleNamespace(
        outputs=[SimpleNamespace(token_ids=token_ids, logprobs=logprobs, finish_reason=finish, weight_versions=spans)]
    )


@pytest.fixture
def fake_vllm(monkeypatch):
    import types

    def module(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)

    params = lambda **kw: SimpleNamespace(kw=kw)  # noqa: E731
    module("vllm", SamplingParams=params, __version__="0.33.0")  # the contract the stand-in follows
    module("vllm.exceptions", RetryableRequestError=_FakeRetryable)
    module("vllm.sampling_params", RequestOutputKind=SimpleNamespace(DELTA="DELTA"))
    module("vllm.engine")
    module("vllm.engine.arg_utils", AsyncEngineArgs=lambda **kw: kw)
    module("vllm.v1")
    module("vllm.v1.engine")
    module("vllm.v1.engine.exceptions", EngineDeadError=type("EngineDeadError", (Exception,), {}))
    module("vllm.v1.engine.async_llm", AsyncLLM=SimpleNamespace(from_engine_args=_FakeAsyncLLM))
    module("vllm.v1.metrics")
    module("vllm.v1.metrics.loggers", StatLoggerBase=object)
    module("vllm.platforms", current_platform=SimpleNamespace(is_cpu=lambda: False))
    module("vllm.distributed")
    module("vllm.distributed.weight_transfer")
    module(
        "vllm.distributed.weight_transfer.base",
        WeightTransferInitRequest=lambda init_info: SimpleNamespace(init_info=init_info),
        WeightTransferUpdateRequest=lambda update_info: SimpleNamespace(update_info=update_info),
    )


def _fake_engine(tmp_path, **kw):
    from asyncrl.rollouter.engines.vllm import VLLMEngine

    (tmp_path / "config.json").write_text('{"eos_token_id": 2}')
    return VLLMEngine(tmp_path, dtype="float32", **kw)


def _receiver(engine, *, join_timeout_s=30.0, timeout_s=30.0):
    from asyncrl.sync.backends import make_receiver
    from asyncrl.sync.base import ReceiverInit

    group = GroupInit(master_addr="127.0.0.1", master_port=1234, world_size=2, timeout_s=timeout_s,
                      join_timeout_s=join_timeout_s)
    return make_receiver(engine, ReceiverInit(method="vllm", group=group, rank_offset=1, options={"packed": True}),
                         engine_kind="vllm")


def test_sampling_outside_vllms_temperature_range_is_refused():
    from asyncrl.rollouter.engines.vllm import check_vllm_temperature

    for t in (2.5, 0.005):
        with pytest.raises(ValueError, match=f"sampling.temperature={t} is outside \\[0.01, 2.0\\]"):
            sampling_kwargs(_request(temperature=t))
    assert sampling_kwargs(_request(temperature=2.0))["temperature"] == 2.0
    assert sampling_kwargs(_request(temperature=0.01))["temperature"] == 0.01
    assert sampling_kwargs(_request(greedy=True, temperature=5.0))["temperature"] == 0.0  # greedy: no temperature
    with pytest.raises(ValueError, match="--temperature=3"):
        check_vllm_temperature(3, "--temperature")


async def test_glue_failed_update_never_resumes(fake_vllm, tmp_path):
    engine = _fake_engine(tmp_path)
    receiver = _receiver(engine)
    await engine.pause("keep")
    with pytest.raises(VLLMWeightSyncError, match="remote peer died"):
        await receiver.receive(names=["boom"], dtype_names=["float32"], shapes=[[1]], version=1)
    assert engine.version == 0
    with pytest.raises(EngineError, match="partly loaded weights"):
        await engine.resume()
    with pytest.raises(VLLMWeightSyncError, match="rebuild the engine"):
        await receiver.receive(names=["w"], dtype_names=["float32"], shapes=[[1]], version=1)
    assert ("resume",) not in engine.llm.calls


async def test_timed_out_rendezvous_marks_the_engine_for_rebuild(fake_vllm, tmp_path):
    # vLLM's worker stays inside a rendezvous nobody completes: the engine must not take more weight calls.
    engine = _fake_engine(tmp_path)
    engine.llm.init_blocks = True
    receiver = _receiver(engine, join_timeout_s=0.2)
    with pytest.raises(VLLMWeightSyncError, match="init_weight_transfer_engine did not finish within "
                                                  "WeightSyncConfig.connect_timeout_s=0.2s"):
        await receiver.connect()
    await engine.pause("keep")
    with pytest.raises(VLLMWeightSyncError, match="rebuild the engine"):
        await receiver.receive(version=1)
    with pytest.raises(EngineError, match="partly loaded"):
        await engine.resume()
    with pytest.raises(ValueError, match="must be in \\(0, 300\\]"):
        _receiver(engine, join_timeout_s=600)
