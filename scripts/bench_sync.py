"""Benchmark the weight sync against a raw gloo broadcast of the same bytes to the same processes.

Setup, per model size: 1 trainer rank (`TrainerWorker`, the model sharded with FSDP2 on a
1-rank gloo world, so every bucket goes through ``full_tensor()``), 2 engine processes
(`EngineActor` + `TorchEngine`, a Qwen2 config widened to about 50 MB and 500 MB of fp32
parameters), one `WeightSyncCoordinator`. ``--repeats`` times (default 5), a raw broadcast then
a sync, interleaved, so both see the same machine; each repeat's ratio is raw_s / sync_s and
the figures are medians over the repeats (with min and max of the ratio):

- ``sync``: `WeightSyncCoordinator.sync()` end to end (pause keep, broadcast, load, resume);
- ``broadcast``: its transfer step alone (trainer gather + pack + broadcast, engines receive
  + ``load_weights`` + finish), as the coordinator times it;
- ``raw``: one ``broadcast`` of a flat uint8 buffer of the same byte count on the same group
  from the same trainer process to the same engine processes, buffers allocated beforehand
  (the limit of this machine's loopback gloo).

``peak_extra_mb_rank0`` is the peak RSS growth of the trainer process during a send
(sampled every millisecond; the first sync allocates the two bucket buffers, which are
then kept), next to the sender's own count of sync buffers + gathered tensors in flight.
After each size it prints the last sync's phases (rank 0 gather / pack / wire wait, engines'
wire wait / load) and, from the per-bucket timelines both sides keep, the overlap: how many
packs ran while the previous bucket was still on the wire, how many engine loads ran while the
next receive was posted, and how long each engine had no receive posted (its wire idle).
Run: ``python scripts/bench_sync.py [--json] [--sizes-mb 50 500] [--bucket-mb 4] [--repeats 5]``.
With ``--lora RANK [RANK ...]`` it compares instead adapter-only (LoRA) syncs with full syncs
(``scripts/lora_bench.py``: bytes, sync time and the trainer's peak memory per rank), by default on
the real Qwen2.5-0.5B shape (``--shape qwen2.5-0.5b``, one engine per trainer); ``--shape sized``
takes the largest ``--sizes-mb`` of the widened Qwen2 shape instead (two engines per trainer).
With ``--json`` the last line is the last size run (500 MB by default):
``{"sync_gb_s", "raw_gb_s", "vs_raw", "vs_raw_median", "vs_raw_min", "vs_raw_max",
"pause_resume_ms", "peak_extra_mb_rank0", "tracked_extra_mb_rank0", "loadavg"}``; ``vs_raw`` =
median raw_s / median sync_s, ``vs_raw_median/min/max`` over the per-repeat raw_s / sync_s
(full sync, pause and resume included); ``loadavg`` is ``os.getloadavg()`` at the end (the
machine is shared: read the figures beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[50.0, 500.0], help="model sizes (fp32 MB)")
    p.add_argument("--bucket-mb", type=float, default=None, help="WeightSyncConfig.bucket_mb (default: its default)")
    p.add_argument("--repeats", "--reps", dest="repeats", type=int, default=5,
                   help="interleaved raw/sync repetitions per size (medians and spread reported)")
    p.add_argument("--json", action="store_true", help="print the JSON summary of the largest size last")
    p.add_argument("--lora", type=int, nargs="+", default=None, metavar="RANK",
                   help="LoRA ranks: adapter-only sync side by side with full sync on --shape (see lora_bench)")
    p.add_argument("--lora-targets", nargs="+", default=None, metavar="MODULE",
                   help="trainer.lora.target_modules for --lora (default: every linear layer of the blocks)")
    p.add_argument("--shape", choices=SHAPES, default="qwen2.5-0.5b",
                   help="model for --lora: qwen2.5-0.5b (default: Qwen2.5-0.5B's config, random weights, one "
                        "engine per trainer) or sized (the largest --sizes-mb of the widened Qwen2 shape)")
    return p.parse_args(argv)


SHAPES = ("qwen2.5-0.5b", "sized")

#: Qwen2.5-0.5B's config.json (no download): 494M parameters, ~1.98 GB of fp32 with the
#: 151936 x 896 embedding tied to the LM head (a full sync sends it once). The bench only syncs and
#: steps, never generates, so the context is left short (256): no parameter depends on it.
QWEN25_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "max_position_embeddings": 256, "hidden_act": "silu"}


def build_qwen25_05b(path: Path) -> Path:
    """The Qwen2.5-0.5B shape with seeded random fp32 weights and the tiny tokenizer (its ids fit the vocabulary)."""
    from transformers import Qwen2Config

    from asyncrl.models.tiny import build_tokenizer, save_random_model

    tok = build_tokenizer()
    cfg = Qwen2Config(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      **QWEN25_05B)
    return save_random_model(cfg, tok, path, seed=0)


def model_overrides(size_mb: float) -> dict:
    """A Qwen2 shape of about ``size_mb`` MB of fp32 parameters (hidden 1024, whole layers)."""
    h, inter = 1024, 3072
    per_layer = 4 * (2 * h * h + 2 * h * (h // 4) + 3 * h * inter + 2 * h) + 4 * (h + 2 * (h // 4))  # bytes
    layers = max(1, round(size_mb * 1e6 / per_layer))
    return dict(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=16,
                num_key_value_heads=4, max_position_embeddings=256)


# -- functions run inside the actors (via __ray_call__) ---------------------------------------


def _start_rss_sampler(self):
    import threading

    import psutil

    proc = psutil.Process()
    self._rss_base = proc.memory_info().rss
    self._rss_peak = self._rss_base
    self._rss_stop = threading.Event()

    def sample():
        while not self._rss_stop.wait(0.001):
            self._rss_peak = max(self._rss_peak, proc.memory_info().rss)

    self._rss_thread = threading.Thread(target=sample, daemon=True)
    self._rss_thread.start()


def _stop_rss_sampler(self):
    self._rss_stop.set()
    self._rss_thread.join(5)
    return {"rss_extra": self._rss_peak - self._rss_base, "tracked": self._sender.stats["peak_extra_bytes"]}


def _asyncrl_file(self):
    import asyncrl

    return asyncrl.__file__


def _raw_prep(self, nbytes: int, root: bool):
    import torch

    self._raw = torch.ones(nbytes, dtype=torch.uint8) if root else torch.zeros(nbytes, dtype=torch.uint8)


def _raw_go(self, root: bool):
    group = self._sender._wait_joined() if root else self._receiver._group
    group.broadcast(self._raw).wait()
    ok = bool(self._raw[-1] == 1)
    del self._raw
    return ok


def overlap(phases: dict) -> dict:
    """Per-bucket overlap of the last sync, from both sides' timelines (perf_counter is one
    monotonic clock for every process on the machine)."""
    send = phases["sender"].get("timeline", [])
    packed = [b for b in send if b[0]]
    out = {"buckets": len(send), "packed": len(packed),
           "packed_while_prev_on_wire": sum(1 for b in packed if b[3]),
           "posted_while_prev_on_wire": sum(1 for b in send[1:] if b[3])}
    for j, r in enumerate(phases["receivers"]):
        tl = r.get("timeline", [])
        gap = sum(max(0.0, tl[i][0] - tl[i - 1][1]) for i in range(1, len(tl)))
        loads = [i for i in range(len(tl)) if tl[i][3] - tl[i][2] > 1e-4]
        overl = sum(1 for i in loads if i + 1 < len(tl) and tl[i + 1][0] <= tl[i][2])
        out[f"engine{j}"] = {"no_receive_posted_ms": round(1e3 * gap, 1), "loads": len(loads),
                             "loads_while_next_posted": overl,
                             "load_ms": round(1e3 * sum(tl[i][3] - tl[i][2] for i in loads), 1)}
    return out


# -- the benchmark --------------------------------------------------------------------------


async def bench_size(size_mb: float, args, tmp: Path) -> dict:
    import ray

    from asyncrl.models.tiny import build_tiny_model
    from asyncrl.rollouter.actor import remote_engine_actor
    from asyncrl.sync.coordinator import WeightSyncConfig, WeightSyncCoordinator
    from asyncrl.trainer.config import TrainerConfig, WorkerConfig
    from asyncrl.trainer.ranks import RankGroup

    path = build_tiny_model(tmp / f"m{int(size_mb)}", seed=0, **model_overrides(size_mb))
    trainer = RankGroup.start_ray(TrainerConfig(worker=WorkerConfig(model_path=str(path), device="cpu"),
                                                world_size=1, cpus_per_rank=0.5))
    cls = remote_engine_actor(num_cpus=0.5)
    engines = [cls.remote(kind="torch", model_path=str(path), eos_token_ids=(), num_threads=1) for _ in range(2)]
    try:
        await asyncio.gather(*[h.ready.remote() for h in engines])
        where = await asyncio.gather(*[a.__ray_call__.remote(_asyncrl_file) for a in [trainer.workers[0], *engines]])
        print(f"    asyncrl imported from {sorted(set(where))} (trainer rank 0, engines); load {os.getloadavg()}",
              flush=True)
        cfg = WeightSyncConfig() if args.bucket_mb is None else WeightSyncConfig(bucket_mb=args.bucket_mb)
        coord = WeightSyncCoordinator(trainer.workers, engines, cfg)
        rank0 = trainer.workers[0]
        # the first sync forms the group, sends the metadata and allocates the sync buffers:
        # its RSS growth on rank 0 is the peak extra memory of a send
        await rank0.__ray_call__.remote(_start_rss_sampler)
        await coord.sync()
        first = await rank0.__ray_call__.remote(_stop_rss_sampler)
        nbytes = (await rank0.__ray_call__.remote(lambda self: self._sender.layout().total_bytes))
        raw, sync, transfer, pause_resume = [], [], [], []
        rss, tracked = [first["rss_extra"]], [first["tracked"]]
        for rep in range(args.repeats):
            await asyncio.gather(rank0.__ray_call__.remote(_raw_prep, nbytes, True),
                                 *[h.__ray_call__.remote(_raw_prep, nbytes, False) for h in engines])
            t0 = time.perf_counter()
            oks = await asyncio.gather(rank0.__ray_call__.remote(_raw_go, True),
                                       *[h.__ray_call__.remote(_raw_go, False) for h in engines])
            raw.append(time.perf_counter() - t0)
            assert all(oks), "raw broadcast did not deliver"

            await rank0.__ray_call__.remote(_start_rss_sampler)
            await coord.sync()
            mem = await rank0.__ray_call__.remote(_stop_rss_sampler)
            sync.append(coord.last.total_s)
            transfer.append(coord.last.transfer_s)
            pause_resume.append(coord.last.pause_s + coord.last.resume_s)
            rss.append(mem["rss_extra"])
            tracked.append(mem["tracked"])
            print(f"    repeat {rep + 1}/{args.repeats}: raw {raw[-1] * 1e3:.0f} ms, sync {sync[-1] * 1e3:.0f} ms "
                  f"(transfer {transfer[-1] * 1e3:.0f}, pause+resume {pause_resume[-1] * 1e3:.1f}), "
                  f"ratio {raw[-1] / sync[-1]:.3f}, load {os.getloadavg()[0]:.2f}", flush=True)
        phases = {"sender": await rank0.__ray_call__.remote(lambda self: dict(self._sender.stats)),
                  "receivers": [await h.__ray_call__.remote(lambda self: dict(self._receiver.stats)) for h in engines]}
        gb = nbytes / 1e9
        med = statistics.median
        ratios = [r / s for r, s in zip(raw, sync)]
        return {
            "size_mb": round(nbytes / 1e6, 1),
            "bucket_mb": cfg.bucket_mb,
            "raw_s": med(raw), "sync_s": med(sync), "broadcast_s": med(transfer),
            "raw_gb_s": gb / med(raw), "sync_gb_s": gb / med(sync), "broadcast_gb_s": gb / med(transfer),
            "vs_raw": med(raw) / med(sync), "broadcast_vs_raw": med(raw) / med(transfer),
            "vs_raw_median": med(ratios), "vs_raw_min": min(ratios), "vs_raw_max": max(ratios),
            "pause_resume_ms": 1000 * med(pause_resume),
            "peak_extra_mb_rank0": max(rss) / 1e6, "tracked_extra_mb_rank0": max(tracked) / 1e6,
            "overlap": overlap(phases),
            "last_sync_phases_ms": {
                "rank0_gather": 1e3 * phases["sender"]["gather_s"], "rank0_pack": 1e3 * phases["sender"]["pack_s"],
                "rank0_wire_wait": 1e3 * phases["sender"]["wire_wait_s"],
                "engine_wire_wait": [round(1e3 * r["wire_wait_s"]) for r in phases["receivers"]],
                "engine_load": [round(1e3 * r["load_s"]) for r in phases["receivers"]],
            },
        }
    finally:
        for h in engines:
            ray.kill(h)
        trainer.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ray

    from asyncrl.placement import start_local_ray

    start_local_ray(num_cpus=4, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    if args.lora:
        from lora_bench import run_lora

        from asyncrl.models.tiny import build_tiny_model

        if args.shape == "qwen2.5-0.5b":
            # ~2 GB per copy: a full trainer with AdamW (~8 GB), a LoRA trainer and one engine each fit
            # a 24 GB machine; two engines each would not leave room for anything else
            shape, build, n_engines = "qwen2.5-0.5b", build_qwen25_05b, 1
        else:
            size = max(args.sizes_mb)
            shape, n_engines = f"sized {size:g} MB", 2
            build = lambda path: build_tiny_model(path, seed=0, **model_overrides(size))
        try:
            return run_lora(args, shape, build, n_engines)
        finally:
            ray.shutdown()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for size in args.sizes_mb:
                row = asyncio.run(bench_size(size, args, Path(tmp)))
                rows.append(row)
                print(
                    f"{row['size_mb']:7.1f} MB fp32, bucket {row['bucket_mb']:g} MB | raw {row['raw_gb_s']:.2f} GB/s "
                    f"({row['raw_s'] * 1e3:.0f} ms) | broadcast+load {row['broadcast_gb_s']:.2f} GB/s "
                    f"({row['broadcast_s'] * 1e3:.0f} ms, x{row['broadcast_vs_raw']:.2f} raw) | full sync "
                    f"{row['sync_gb_s']:.2f} GB/s ({row['sync_s'] * 1e3:.0f} ms, x{row['vs_raw']:.2f} raw) | "
                    f"pause+resume {row['pause_resume_ms']:.1f} ms | rank0 peak extra RSS "
                    f"{row['peak_extra_mb_rank0']:.0f} MB (sync buffers {row['tracked_extra_mb_rank0']:.0f} MB)",
                    flush=True,
                )
                print("    last sync, ms:", {k: (round(v) if isinstance(v, float) else v)
                                             for k, v in row["last_sync_phases_ms"].items()}, flush=True)
                print("    last sync, per bucket:", row["overlap"], flush=True)
    finally:
        ray.shutdown()
    if args.json:
        last = rows[-1]
        keys = ("sync_gb_s", "raw_gb_s", "vs_raw", "vs_raw_median", "vs_raw_min", "vs_raw_max", "pause_resume_ms",
                "peak_extra_mb_rank0", "tracked_extra_mb_rank0")
        print(json.dumps({**{k: round(last[k], 3) for k in keys}, "repeats": args.repeats,
                          "loadavg": [round(x, 2) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
