"""GPU benchmark: the built-in engine's generation, its in-place weight reload and one trainer
rank's log-prob and training throughput, on one device, in one process (no Ray, no vLLM).

Model: a random Qwen2 saved to a temporary directory, shaped like Qwen2.5-0.5B by default
(hidden 896, intermediate 4864, 24 layers, 14 query / 2 key-value heads, vocab 151936, tied
embeddings), run in bfloat16 on CUDA. ``--tiny`` takes the tiny default model's shape (hidden 64,
2 layers, head size 32, a 56-token vocab) for a smoke check on CPU.

Sections, each printed as soon as it is measured; one that fails prints its traceback and the
next one still runs:

1. generation: the built-in ``TorchEngine`` (continuous batching, ``--slots`` requests at once)
   against static-batch HF ``model.generate`` (left padded, consecutive batches of ``--slots``)
   on the same prompts and assigned response lengths (``bench_engine.workload``: ``--prompts``
   requests, median length ``--median``, long tail up to 16x), greedy, EOS off, same dtype and
   device. Each is warmed up once on the whole batch with short responses, then ``--reps`` timed
   runs in alternating order (fewer when ``--gen-budget-s`` runs out). Reports tok/s (assigned
   response tokens / wall seconds, medians), ``speedup`` = static_s / engine_s and the fraction
   of responses whose greedy tokens equal (bf16 may diverge: reported, not asserted).
2. reload: one more engine run that pauses with ``keep`` mid-generation (the longest request
   half done), loads the engine's own weights in place (``load_weights``), makes them live
   (``finish_weight_update``) and resumes; reports the seconds from pause to resume, the
   tokens re-prefilled (``stats()["reprefill_tokens"]``, target 0) and whether the tokens equal
   the run without a pause.
3. training: one ``TrainerWorker`` rank (world size 1, FSDP2; bf16 mixed precision and nccl on
   CUDA, fp32 and gloo on CPU) on a batch of ``--prompts`` rows of the workload's prompt and
   response lengths (random response tokens, masks and advantages as the tests build them; the
   old log-probs are the rank's own from the warm-up ``compute_logprobs``, so the step is
   on-policy); times ``compute_logprobs`` and ``train_minibatch`` (one warm-up, then
   ``--train-reps``) and reports tokens/s over all real tokens (prompt + response) and, on CUDA,
   the peak GPU memory of the section (``torch.cuda.max_memory_allocated``).

Also printed: load average (start and end), device name, torch and transformers versions.
``--skip generation,reload,training`` leaves sections out; ``--layers`` shrinks the model.

Run:

    python scripts/bench_gpu.py                      # on a CUDA machine (defaults above)
    python scripts/bench_gpu.py --json               # last line: one JSON object
    python scripts/bench_gpu.py --device cpu --tiny --prompts 8 --median 8 --reps 1   # smoke check
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_engine's workload and static runner
from bench_engine import EngineRunner, StaticRunner  # noqa: E402

#: Qwen2.5-0.5B's shape (random weights).
QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
                rms_norm_eps=1e-6, max_position_embeddings=32768)

T0 = time.perf_counter()


def say(msg: str = "") -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--dtype", default=None, help="model dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--tiny", action="store_true", help="the tiny model's shape (smoke check)")
    p.add_argument("--prompts", type=int, default=64, help="number of requests (and training rows)")
    p.add_argument("--median", type=int, default=128, help="median response length")
    p.add_argument("--slots", type=int, default=64, help="engine max_running = static batch size")
    p.add_argument("--reps", type=int, default=3, help="timed generation runs of each system")
    p.add_argument("--gen-budget-s", type=float, default=300.0,
                   help="start no further generation rep when it would end past this many seconds")
    p.add_argument("--train-reps", type=int, default=3, help="timed compute_logprobs / train_minibatch calls")
    p.add_argument("--micro-batch", type=int, default=4, help="trainer micro_batch_size")
    p.add_argument("--layers", type=int, default=None, help="num_hidden_layers (default: the shape's own)")
    p.add_argument("--init-range", type=float, default=None,
                   help="initializer_range of the random weights (default 0.2 tiny, 0.1 otherwise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help="comma-separated sections to leave out: generation,reload,training")
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    return p.parse_args(argv)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_model(args, tmp: str, positions: int) -> Path:
    if args.tiny:
        from asyncrl.models.tiny import build_tiny_model

        layers = {} if args.layers is None else {"num_hidden_layers": args.layers}
        return build_tiny_model(tmp, seed=args.seed, initializer_range=args.init_range or 0.2,
                                max_position_embeddings=max(256, positions), **layers)
    from transformers import Qwen2Config

    from asyncrl.models.tiny import build_tokenizer, save_random_model

    tok = build_tokenizer()  # saved beside the model; nothing here decodes text
    cfg = Qwen2Config(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      initializer_range=args.init_range or 0.1,
                      **{**QWEN_05B, "max_position_embeddings": max(QWEN_05B["max_position_embeddings"], positions),
                         "num_hidden_layers": args.layers or QWEN_05B["num_hidden_layers"]})
    return save_random_model(cfg, tok, tmp, args.seed)


# ------------------------------------------------------------------------------ generation


class Engine(EngineRunner):
    """`bench_engine.EngineRunner` on ``device`` in ``dtype``, kept across runs; its warm-up is the
    bench's own (whole batch, short). ``run`` also returns the step counters' change and the
    seconds of a pause(keep) + reload."""

    def __init__(self, model_path, slots, device, dtype):
        super().__init__(model_path, slots, device=device, dtype=dtype)
        self.runs = 1  # EngineRunner warms up on its first run only

    async def run(self, prompts, lengths, pause_keep=False):
        ids, seconds = await super().run(prompts, lengths, pause_keep=pause_keep)
        return ids, seconds, self.delta, self.reload_s


class Static(StaticRunner):
    """`bench_engine.StaticRunner` on the device; its warm-up is the bench's own (whole batch, short)."""

    def __init__(self, model_path, slots, device, dtype):
        super().__init__(model_path, slots, device, dtype)
        self.warm = True


def equal_fraction(a, b, lengths) -> float:
    import numpy as np

    same = [len(x) >= n and len(y) >= n and np.array_equal(np.asarray(x)[:n], np.asarray(y)[:n])
            for x, y, n in zip(a, b, lengths)]
    return sum(same) / max(1, len(same))


async def generation_sections(args, model_path, dtype, prompts, lengths, report, skip):
    """Sections 1 (generation) and 2 (reload) on one event loop (the engine's scheduler lives there)."""
    total = sum(lengths)
    engine = static = None
    try:
        if "generation" in skip:
            say("generation: skipped (--skip)")
        else:
            try:
                say("generation: loading the engine and the static model ...")
                engine = Engine(model_path, args.slots, args.device, dtype)
                static = Static(model_path, args.slots, args.device, dtype)
                # Warm-up: the whole batch with short responses (every batch shape's first call costs more).
                warm = [min(n, 8) for n in lengths]
                t = time.perf_counter()
                await engine.run(prompts, warm)
                say(f"generation: engine warm-up {time.perf_counter() - t:.2f} s")
                t = time.perf_counter()
                static.run(prompts, warm)
                say(f"generation: static warm-up {time.perf_counter() - t:.2f} s")
                seconds = {"engine": [], "static": []}
                outputs = {}
                gen_start = time.perf_counter()
                for rep in range(args.reps):
                    if rep > 0:  # stop before a rep that would end past the budget
                        per_rep = (time.perf_counter() - gen_start) / rep
                        if time.perf_counter() - gen_start + per_rep > args.gen_budget_s:
                            say(f"generation: stopping after {rep} rep(s): --gen-budget-s {args.gen_budget_s} "
                                f"(a rep takes ~{per_rep:.1f} s)")
                            break
                    for name in (["engine", "static"] if rep % 2 == 0 else ["static", "engine"]):
                        if name == "engine":
                            outs, s, delta, _ = await engine.run(prompts, lengths)
                            extra = f", {delta['steps']} steps, {delta['prefill_tokens']} prefill tokens"
                        else:
                            outs, s = static.run(prompts, lengths)
                            extra = ""
                        seconds[name].append(s)
                        outputs.setdefault(name, outs)
                        say(f"generation rep {rep}: {name:6s} {s:7.2f} s  {total / s:9.1f} tok/s{extra}")
                med = {k: statistics.median(v) for k, v in seconds.items()}
                assert [len(r) for r in outputs["engine"]] == lengths, "engine response lengths differ from assigned"
                frac = equal_fraction(outputs["engine"], outputs["static"], lengths)
                gen = dict(engine_tok_s=round(total / med["engine"], 1), static_tok_s=round(total / med["static"], 1),
                           speedup=round(med["static"] / med["engine"], 3), engine_s=[round(x, 3) for x in seconds["engine"]],
                           static_s=[round(x, 3) for x in seconds["static"]], gen_reps=len(seconds["engine"]),
                           tokens_equal_fraction=round(frac, 4),
                           distinct_tokens=len({int(x) for r in outputs["engine"] for x in r}))
                report.update(gen)
                report["_engine_outputs"] = outputs["engine"]
                say(f"GENERATION: engine {gen['engine_tok_s']} tok/s, static generate {gen['static_tok_s']} tok/s, "
                    f"speedup {gen['speedup']}x (median of {gen['gen_reps']}); greedy tokens equal in "
                    f"{frac:.1%} of responses; {gen['distinct_tokens']} distinct tokens generated")
            except Exception:
                report["errors"].append("generation")
                say("generation FAILED:\n" + traceback.format_exc())
            finally:
                if static is not None:
                    del static.model
                    static = None
                gc.collect()

        if "reload" in skip:
            say("reload: skipped (--skip)")
        else:
            try:
                if engine is None:
                    say("reload: loading the engine ...")
                    engine = Engine(model_path, args.slots, args.device, dtype)
                kept, s, delta, reload_s = await engine.run(prompts, lengths, pause_keep=True)
                rel = dict(reload_run_s=round(s, 3), reload_s=round(reload_s, 4),
                           reprefill_tokens=int(delta["reprefill_tokens"]),
                           reprefill_tokens_total=int(engine.engine.stats()["reprefill_tokens"]),
                           engine_version=engine.engine.version)
                base = report.pop("_engine_outputs", None)
                if base is not None:
                    rel["tokens_equal_after_keep"] = round(equal_fraction(kept, base, lengths), 4)
                report.update(rel)
                say(f"RELOAD: pause(keep)+load_weights+finish_weight_update+resume took {reload_s:.3f} s "
                    f"(run {s:.2f} s, {total / s:.1f} tok/s); reprefill_tokens={rel['reprefill_tokens']} (target 0); "
                    f"tokens equal the unpaused run: {rel.get('tokens_equal_after_keep', 'n/a')}")
            except Exception:
                report["errors"].append("reload")
                say("reload FAILED:\n" + traceback.format_exc())
    finally:
        report.pop("_engine_outputs", None)
        if engine is not None:
            try:
                await engine.engine.close()
            except Exception:
                say("engine close failed:\n" + traceback.format_exc())
            engine = None
        gc.collect()


# ------------------------------------------------------------------------------ training


def training_batch(prompts, lengths, vocab: int, seed: int):
    """Right-padded rows of prompt + response (random response tokens), as the batch assembly lays them out."""
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    rows = len(prompts)
    plen = torch.tensor([len(p) for p in prompts])
    total = plen + torch.tensor(lengths)
    width = int(total.max())
    cols = torch.arange(width)[None]
    attention = (cols < total[:, None]).long()
    response = attention * (cols >= plen[:, None]).long()
    ids = torch.randint(3, vocab, (rows, width), generator=g) * attention
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.as_tensor(p)
    advantages = torch.randn(rows, 1, generator=g).expand(rows, width) * response
    return TensorDict({
        "input_ids": ids, "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        "old_logprobs": (-0.5 - torch.rand(rows, width, generator=g)) * response,
        "advantages": advantages.contiguous(), "response_mask": response,
    }, batch_size=[rows])


def training_section(args, model_path, prompts, lengths, report):
    import torch
    import torch.distributed as dist

    from asyncrl.net import free_port
    from asyncrl.trainer.config import OptimConfig, WorkerConfig
    from asyncrl.trainer.worker import TrainerWorker

    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cfg = WorkerConfig(model_path=str(model_path), micro_batch_size=args.micro_batch,
                       device="cuda" if cuda else "cpu", optim=OptimConfig(lr=1e-6))
    say("training: building the TrainerWorker ...")
    t = time.perf_counter()
    worker = TrainerWorker(cfg, rank=0, world_size=1, master_port=free_port())
    say(f"training: worker ready in {time.perf_counter() - t:.1f} s")
    try:
        vocab = int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
        batch = training_batch(prompts, lengths, vocab, args.seed)
        tokens = int(batch["attention_mask"].sum())
        resp = int(batch["response_mask"].sum())
        denom = float(resp)

        def timed(fn):
            sync(args.device)
            t = time.perf_counter()
            out = fn()
            sync(args.device)
            return out, time.perf_counter() - t

        lp, s = timed(lambda: worker.compute_logprobs(batch))
        say(f"training: compute_logprobs warm-up {s:.2f} s")
        # Behaviour log-probs = the current weights' (on-policy: ratio 1, so PPO's clip leaves the gradient on).
        batch["old_logprobs"] = lp * batch["response_mask"]
        lp_s = []
        for i in range(args.train_reps):
            _, s = timed(lambda: worker.compute_logprobs(batch))
            lp_s.append(s)
            say(f"training rep {i}: compute_logprobs {s:.3f} s  {tokens / s:9.1f} tok/s")
        out, s = timed(lambda: worker.train_minibatch(batch, denom))
        say(f"training: train_minibatch warm-up {s:.2f} s (loss {out['loss']:.4f}, grad_norm {out['grad_norm']:.4f})")
        tr_s = []
        for i in range(args.train_reps):
            out, s = timed(lambda: worker.train_minibatch(batch, denom))
            tr_s.append(s)
            say(f"training rep {i}: train_minibatch {s:.3f} s  {tokens / s:9.1f} tok/s (loss {out['loss']:.4f})")
        lp_med, tr_med = statistics.median(lp_s), statistics.median(tr_s)
        res = dict(train_rows=len(prompts), train_tokens=tokens, train_response_tokens=resp,
                   train_width=int(batch["input_ids"].shape[1]), micro_batch=args.micro_batch,
                   logprobs_s=[round(x, 4) for x in lp_s], logprobs_tok_s=round(tokens / lp_med, 1),
                   train_s=[round(x, 4) for x in tr_s], train_tok_s=round(tokens / tr_med, 1))
        if cuda:
            res["train_peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        report.update(res)
        say(f"TRAINING: {len(prompts)} rows, {tokens} tokens ({resp} response), micro-batch {args.micro_batch}: "
            f"compute_logprobs {res['logprobs_tok_s']} tok/s, train_minibatch {res['train_tok_s']} tok/s"
            + (f", peak GPU memory {res['train_peak_mem_gib']} GiB" if cuda else ""))
    finally:
        worker.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        worker = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    from bench_engine import workload

    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    report: dict = {"errors": [], "device": args.device, "dtype": str(dtype).replace("torch.", ""),
                    "tiny": args.tiny, "torch": torch.__version__, "transformers": transformers.__version__,
                    "prompts": args.prompts, "median": args.median, "slots": args.slots}
    try:
        report["device_name"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    except Exception as exc:  # noqa: BLE001 - reported, the sections then say what fails
        report["device_name"] = f"unavailable: {exc!r}"
    report["load_start"] = [round(x, 2) for x in os.getloadavg()]
    say(f"torch {torch.__version__}, transformers {transformers.__version__}, python {sys.version.split()[0]}, "
        f"device {args.device} ({report['device_name']}), dtype {report['dtype']}, load {report['load_start']}")

    prompts, lengths = workload(args.prompts, args.median, args.seed)
    total = sum(lengths)
    report.update(tokens=total, max_len=max(lengths), median_len=int(statistics.median(lengths)))
    say(f"workload: {args.prompts} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {total} "
        f"response tokens (median {report['median_len']}, max {report['max_len']}), {args.slots} slots")
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        try:
            model_path = build_model(args, tmp, max(len(p) for p in prompts) + max(lengths) + 1)
        except Exception:
            say("model build FAILED:\n" + traceback.format_exc())
            report["errors"].append("model")
            model_path = None
        if model_path is not None:
            cfg = json.loads((Path(model_path) / "config.json").read_text())
            report["model"] = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                   "num_attention_heads", "num_key_value_heads", "vocab_size")}
            say(f"model: random Qwen2 {report['model']} built in {time.perf_counter() - t:.1f} s")
            try:
                asyncio.run(generation_sections(args, model_path, dtype, prompts, lengths, report, skip))
            except Exception:
                report["errors"].append("generation/reload loop")
                say("generation/reload loop FAILED:\n" + traceback.format_exc())
            if args.device.startswith("cuda"):
                try:
                    report["gen_peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                    torch.cuda.empty_cache()
                except Exception:
                    say("cuda memory stats failed:\n" + traceback.format_exc())
            if "training" in skip:
                say("training: skipped (--skip)")
            else:
                try:
                    training_section(args, model_path, prompts, lengths, report)
                except Exception:
                    report["errors"].append("training")
                    say("training FAILED:\n" + traceback.format_exc())
    report["load_end"] = [round(x, 2) for x in os.getloadavg()]
    report["wall_s"] = round(time.perf_counter() - T0, 1)
    say(f"done in {report['wall_s']} s; load {report['load_end']}; device {report['device_name']}; torch "
        f"{torch.__version__}; failed sections: {report['errors'] or 'none'}")
    if args.json:
        print(json.dumps(report), flush=True)
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
