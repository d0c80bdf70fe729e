"""``bench_sync.py --lora RANK [RANK ...]``: adapter-only (LoRA) weight sync against full sync.

Per LoRA rank, on the model bench_sync builds (``--shape``: Qwen2.5-0.5B's config with random
weights by default, or the largest ``--sizes-mb`` of its widened Qwen2 shape): two trainer ranks
(`TrainerWorker`, 1-rank FSDP2 each), one full and one with ``trainer.lora.rank=RANK`` (target modules:
``--lora-targets``, default every linear layer of the blocks), each with its own `TorchEngine` actors
(one for the 0.5B shape, two for the sized one) and `WeightSyncCoordinator`. After a first sync of each
(group, metadata, buffers), ``--repeats`` rounds of one full sync then one LoRA sync, interleaved,
and one optimizer step of each trainer on the same random batch with its peak RSS growth
(sampled every millisecond) and its RSS after the step. Figures are medians over the repeats:

- ``bytes_full`` / ``bytes_lora``: what one sync puts on the wire (the layout's bytes);
- ``sync_s_full`` / ``sync_s_lora``: `WeightSyncCoordinator.sync()` end to end (pause keep,
  transfer, the engines' load (LoRA: merge onto the kept base, then load), resume);
- ``step_peak_mb_*``: the trainer process's RSS growth during one optimizer step (the first
  step allocates AdamW's state: full fine-tuning two fp32 copies of the model, LoRA of the adapters).

Last line (with ``--json``): the row of rank 16 if asked for, else of the first rank, plus every
row under ``ranks``.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def _rss_mb(self):
    import psutil

    return psutil.Process().memory_info().rss / 1e6


def _step(self, batch, denom):
    """One optimizer step with the peak RSS growth sampled every millisecond (inside the rank actor)."""
    import threading

    import psutil

    proc = psutil.Process()
    base = peak = proc.memory_info().rss
    stop = threading.Event()

    def sample():
        nonlocal peak
        while not stop.wait(0.001):
            peak = max(peak, proc.memory_info().rss)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        self.train_minibatch(batch, denom)
    finally:
        stop.set()
        thread.join(5)
    return {"peak_extra_mb": (peak - base) / 1e6, "rss_after_mb": proc.memory_info().rss / 1e6}


def _batch(vocab: int):
    from asyncrl.trainer.batch import assemble
    from asyncrl.types import Group, Trajectory

    rng = np.random.default_rng(0)
    groups = []
    for i in range(4):
        trajs = [Trajectory(sample_id=f"sample_0_{i}", index=k, prompt_ids=rng.integers(3, vocab, size=16),
                            response_ids=rng.integers(3, vocab, size=32),
                            logprobs=np.full(32, -3.0, np.float32), versions=np.zeros(32, np.int64),
                            finish_reason="stop", reward=float(k % 2)) for k in range(4)]
        groups.append(Group(sample_id=f"sample_0_{i}", trajectories=trajs, expected=4))
    batch = assemble(groups, pad_token_id=0, norm_adv_by_std=True)
    return batch, float(batch["response_mask"].sum())


class Side:
    """One trainer rank, its engines and its coordinator."""

    def __init__(self, path: Path, lora_rank: int, targets: list[str] | None = None, n_engines: int = 2):
        from asyncrl.rollouter.actor import remote_engine_actor
        from asyncrl.sync.coordinator import WeightSyncConfig, WeightSyncCoordinator
        from asyncrl.trainer.config import LoraConfig, TrainerConfig, WorkerConfig
        from asyncrl.trainer.ranks import RankGroup

        worker = WorkerConfig(model_path=str(path), device="cpu", micro_batch_size=4,
                              lora=LoraConfig(rank=lora_rank, target_modules=targets))
        self.trainer = RankGroup.start_ray(TrainerConfig(worker=worker, world_size=1, cpus_per_rank=0.25))
        cls = remote_engine_actor(num_cpus=0.25)
        self.engines = [cls.remote(kind="torch", model_path=str(path), eos_token_ids=(), num_threads=1)
                        for _ in range(n_engines)]
        self.coord = WeightSyncCoordinator(self.trainer.workers, self.engines, WeightSyncConfig())
        self.rank0 = self.trainer.workers[0]

    async def sync(self) -> float:
        await self.coord.sync()
        return self.coord.last.total_s

    async def nbytes(self) -> int:
        return await self.rank0.__ray_call__.remote(lambda self: self._sender.layout().total_bytes)

    def close(self) -> None:
        import ray

        for h in self.engines:
            ray.kill(h)
        self.trainer.close()


async def bench_rank(path: Path, rank: int, repeats: int, vocab: int, targets: list[str] | None,
                     n_engines: int) -> dict:
    full = Side(path, 0, n_engines=n_engines)
    lora = Side(path, rank, targets if rank else None, n_engines)
    try:
        await asyncio.gather(*[h.ready.remote() for h in full.engines + lora.engines])
        await full.sync()
        await lora.sync()  # forms the group, sends the metadata, reads the engines' base copies
        times = {"full": [], "lora": []}
        for rep in range(repeats):
            for name, side in (("full", full), ("lora", lora)):
                times[name].append(await side.sync())
            print(f"    rank {rank} repeat {rep + 1}/{repeats}: full {times['full'][-1] * 1e3:.0f} ms, "
                  f"lora {times['lora'][-1] * 1e3:.0f} ms, load {os.getloadavg()[0]:.2f}", flush=True)
        batch, denom = _batch(vocab)
        steps = {name: await side.rank0.__ray_call__.remote(_step, batch, denom)
                 for name, side in (("full", full), ("lora", lora))}
        med = statistics.median
        row = {"lora_rank": rank, "targets": targets or "all linear",
               "bytes_full": await full.nbytes(), "bytes_lora": await lora.nbytes(),
               "sync_s_full": med(times["full"]), "sync_s_lora": med(times["lora"]),
               "step_peak_mb_full": steps["full"]["peak_extra_mb"], "step_peak_mb_lora": steps["lora"]["peak_extra_mb"],
               "rss_after_step_mb_full": steps["full"]["rss_after_mb"],
               "rss_after_step_mb_lora": steps["lora"]["rss_after_mb"]}
        row["bytes_ratio"] = row["bytes_full"] / row["bytes_lora"]
        row["time_ratio"] = row["sync_s_full"] / row["sync_s_lora"]
        return row
    finally:
        full.close()
        lora.close()


def run_lora(args, shape: str, build, n_engines: int) -> int:
    """``build(path)`` saves the model to ``path`` (bench_sync's shapes); ``n_engines`` engines per trainer."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp) / "m")
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        for rank in args.lora:
            t0 = time.perf_counter()
            row = asyncio.run(bench_rank(path, rank, args.repeats, vocab, args.lora_targets, n_engines))
            rows.append(row)
            print(f"rank {rank:3d}: bytes {row['bytes_full'] / 1e6:.1f} MB -> {row['bytes_lora'] / 1e6:.2f} MB "
                  f"({row['bytes_ratio']:.0f}x fewer), sync {row['sync_s_full'] * 1e3:.0f} -> "
                  f"{row['sync_s_lora'] * 1e3:.0f} ms ({row['time_ratio']:.1f}x less), trainer step peak extra RSS "
                  f"{row['step_peak_mb_full']:.0f} -> {row['step_peak_mb_lora']:.0f} MB, RSS after the step "
                  f"{row['rss_after_step_mb_full']:.0f} -> {row['rss_after_step_mb_lora']:.0f} MB "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.json:
        top = next((r for r in rows if r["lora_rank"] == 16), rows[0])
        print(json.dumps({**{k: (round(v, 4) if isinstance(v, float) else v) for k, v in top.items()},
                          "shape": shape, "engines_per_trainer": n_engines, "repeats": args.repeats, "ranks": rows,
                          "loadavg": [round(x, 2) for x in os.getloadavg()]}))
    return 0
