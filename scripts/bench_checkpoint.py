"""Benchmark the Trainer's checkpoint write and resume against a plain torch.save / torch.load.

Setup, per model: one trainer rank in this process (`RankGroup.start_local`: the model sharded
with FSDP2 on a 1-rank gloo world), one optimizer step taken so AdamW's state exists, a
committed set of ``--committed`` ids. Models: the demo's (the tiny Qwen2 config, ~0.2M
parameters) and a Qwen2 config widened to about 500 MB of fp32 parameters. Every figure is the
median of ``--reps`` runs:

- ``save_s``: `Trainer.save_checkpoint()` (DCP shards of model + optimizer written and fsynced,
  sidecar, rename, ``latest``, samples.jsonl, acks);
- ``restore_s``: `Trainer.restore()` into the running rank (DCP load of model + optimizer,
  sidecar, samples.jsonl repair);
- baseline ``torch_save_s`` / ``torch_load_s``: ``torch.save`` of the same rank's model and
  optimizer ``state_dict()`` to one file (fsynced), and ``torch.load`` + ``load_state_dict``.

Run: ``python scripts/bench_checkpoint.py [--json] [--sizes tiny 500] [--reps 3]``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "500"], help="'tiny' (the demo's) and/or fp32 MB")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median reported)")
    p.add_argument("--committed", type=int, default=100_000, help="ids in the committed set")
    p.add_argument("--json", action="store_true", help="print one JSON object per size")
    return p.parse_args(argv)


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


async def bench(size: str, reps: int, n_committed: int, tmp: Path) -> dict:
    import torch

    from asyncrl.models.tiny import build_tiny_model
    from asyncrl.trainer.config import TrainerConfig, WorkerConfig
    from asyncrl.trainer.ranks import RankGroup
    from asyncrl.trainer.trainer import MemorySource, Trainer
    from asyncrl.types import CommittedSet

    if size == "tiny":
        path = build_tiny_model(tmp / "tiny")
    else:
        from bench_sync import model_overrides

        path = build_tiny_model(tmp / f"m{size}", **model_overrides(float(size)))
    cfg = TrainerConfig(worker=WorkerConfig(model_path=str(path), device="cpu"),
                        checkpoint_dir=str(tmp / f"ckpt-{size}"), samples_path=str(tmp / f"samples-{size}.jsonl"))
    ranks = RankGroup.start_local(cfg)
    try:
        worker = ranks.workers[0]
        for p in worker.model.parameters():  # one step, so AdamW's state is part of the checkpoint
            p.grad = torch.zeros_like(p)
        worker.optimizer.step()
        worker.optimizer.zero_grad(set_to_none=True)
        params = sum(p.numel() for p in worker.model.parameters())
        trainer = Trainer(cfg, ranks, MemorySource(), rollouter_state=lambda: {"next_index": n_committed + 64})
        # A long run's committed set: everything below the ids in flight, a few done out of order.
        done = [*range(n_committed), *range(n_committed + 1, n_committed + 64, 2)]
        trainer.committed = CommittedSet(f"sample_0_{i}" for i in done)
        out = {"size": size, "params_m": round(params / 1e6, 2), "save_s": [], "restore_s": [],
               "torch_save_s": [], "torch_load_s": []}
        plain = tmp / f"plain-{size}.pt"
        for rep in range(reps):
            trainer.step = rep + 1
            t0 = time.perf_counter()
            await trainer.save_checkpoint()
            out["save_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert await Trainer(cfg, ranks, MemorySource()).restore()
            out["restore_s"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            with open(plain, "wb") as f:
                torch.save({"model": worker.model.state_dict(), "optim": worker.optimizer.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            out["torch_save_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            state = torch.load(plain, weights_only=False)
            worker.model.load_state_dict(state["model"])
            worker.optimizer.load_state_dict(state["optim"])
            out["torch_load_s"].append(time.perf_counter() - t0)
            del state
        latest = Path(cfg.checkpoint_dir) / (Path(cfg.checkpoint_dir) / "latest").read_text().strip()
        out["checkpoint_mb"] = round(_dir_bytes(latest) / 1e6, 1)
        out["sidecar_bytes"] = (latest / "trainer_state.json").stat().st_size
        out["torch_file_mb"] = round(plain.stat().st_size / 1e6, 1)
        for k in ("save_s", "restore_s", "torch_save_s", "torch_load_s"):
            out[k] = round(statistics.median(out[k]), 3)
        out["save_vs_torch"] = round(out["save_s"] / out["torch_save_s"], 2)
        out["restore_vs_torch"] = round(out["restore_s"] / out["torch_load_s"], 2)
        return out
    finally:
        ranks.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    print(f"load: {os.getloadavg()}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        for size in args.sizes:
            r = asyncio.run(bench(size, args.reps, args.committed, Path(tmp)))
            if args.json:
                print(json.dumps(r))
            else:
                print(f"{size:>5}: {r['params_m']}M params, checkpoint {r['checkpoint_mb']} MB "
                      f"(sidecar {r['sidecar_bytes']} B for {args.committed} committed ids): "
                      f"save {r['save_s']}s vs torch.save {r['torch_save_s']}s ({r['save_vs_torch']}x), "
                      f"restore {r['restore_s']}s vs torch.load {r['torch_load_s']}s ({r['restore_vs_torch']}x)")
    print(f"load: {os.getloadavg()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
