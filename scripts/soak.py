"""Soak: the CPU demo for 1000 steps, watched every 50 steps for anything that grows.

verl's users report a param_sync that grows from seconds to ~25 minutes over a long run; a leak
of memory, file descriptors or bookkeeping shows only after hundreds of steps. This runs
``python -m asyncrl.launch --steps N`` (the demo: built-in engine, one FSDP2 rank, the ZeroMQ
stream, a weight sync after every step) in a fresh run directory and, each time the run passes a
multiple of ``--every`` steps, samples every process of the run (the launcher and its process
tree: Ray's GCS and raylet, the Trainer rank, the Rollouter, the engine replica): resident memory
and open file descriptors. The run's own per-step metrics (``events.jsonl``, one event per metric) give the step time
(``timing_s/step``), ``timing_s/param_sync``, the stream's depth (``stream/depth``) and credit
(``stream/credit``) and the committed set's size (``stream/committed_kept``: ids kept one by one).

Targets (issue 25): the median of steps 900-1000 within 20% of steps 100-200 for the step time
and param_sync (for N steps: the last tenth over the second tenth); RSS growth <= 10% and open
fds flat from step 100 to the last sample before step N (taken while the run still works); no step
from step 10 on slower than 10x the median. The last line with ``--json``:
``{"steps", "step_time_ratio", "param_sync_ratio", "rss_growth", "fd_growth", "max_step_vs_median"}``
(ratios: the last window over the first).

    python scripts/soak.py --json                    # 1000 steps, ~6 minutes on 2 cores
    python scripts/soak.py --steps 200 --every 20    # a shorter look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--every", type=int, default=50, help="sample the processes every this many steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=None, help="default: a fresh temporary directory")
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    p.add_argument("launch_args", nargs="*", help="more arguments for asyncrl.launch (dotted overrides, flags after --)")
    return p.parse_args(argv)


def _name(proc: psutil.Process) -> str:
    """A short, stable name: Ray workers by their actor class, others by their program."""
    try:
        title = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return "?"
    if title.startswith("ray::"):
        return title.split()[0].split(".")[0]  # ray::EngineActor.receive_weights -> ray::EngineActor
    for known in ("gcs_server", "raylet", "dashboard", "log_monitor", "runtime_env", "monitor.py", "asyncrl.launch"):
        if known in title:
            return known
    return Path(title.split()[0]).name


def sample(root: int) -> dict[str, dict]:
    """RSS (MB) and open fds of the launcher and every process under it, by name (pid when names repeat)."""
    out: dict[str, dict] = {}
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for proc in procs:
        try:
            rss, fds = proc.memory_info().rss / 2**20, proc.num_fds()
        except psutil.Error:
            continue
        name = _name(proc)
        key = name if name not in out else f"{name}[{proc.pid}]"
        out[key] = {"pid": proc.pid, "rss_mb": round(rss, 1), "fds": fds}
    return out


class MetricsTail:
    """The run's ``events.jsonl`` read as it grows (only new lines each time): step -> metrics.
    Events of no step (the Rollouter's, ``step`` -1) count for the latest step seen."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.steps = path, 0, {}
        self.latest: dict[str, float] = {}
        """The latest value of every metric (the Rollouter's stream credit, say)."""
        self._partial = ""

    def poll(self) -> dict[int, dict]:
        if not self.path.exists():
            return self.steps
        with self.path.open() as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()  # a line still being written
        for line in lines:
            if not line.strip():
                continue
            event = json.loads(line)
            self.latest[event["name"]] = event["value"]
            step = event.get("step", -1)
            if step < 0:
                step = max(self.steps, default=0)
            self.steps.setdefault(step, {})[event["name"]] = event["value"]
        return self.steps


def _median_of(steps: dict[int, dict], key: str, lo: int, hi: int) -> float | None:
    xs = [m[key] for s, m in steps.items() if lo <= s <= hi and isinstance(m.get(key), (int, float))]
    return statistics.median(xs) if xs else None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="asyncrl-soak-")) / "run"
    cmd = [sys.executable, "-m", "asyncrl.launch", "--steps", str(args.steps), "--seed", str(args.seed),
           "--run-dir", str(run_dir), *args.launch_args]
    load = os.getloadavg()
    print(f"soak: {' '.join(cmd[1:])}; load average {load[0]:.2f} {load[1]:.2f}", flush=True)
    log = open(run_dir.parent / "launch.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    samples: dict[int, dict] = {}
    t0, next_sample, tail = time.monotonic(), args.every, MetricsTail(run_dir / "events.jsonl")
    try:
        while proc.poll() is None:
            time.sleep(0.2)
            steps = tail.poll()
            done = max(steps, default=0)
            if next_sample <= done < args.steps:  # (not at the last step: the run is closing then)
                samples[done] = sample(proc.pid)
                m = {**steps[done], **{k: v for k, v in tail.latest.items() if k.startswith("stream/")}}
                total = sum(p["rss_mb"] for p in samples[done].values())
                fds = sum(p["fds"] for p in samples[done].values())
                print(f"  step {done:5d}  {time.monotonic() - t0:6.0f} s  step {m.get('timing_s/step', 0):.3f} s  "
                      f"param_sync {m.get('timing_s/param_sync', 0) * 1e3:6.1f} ms  RSS {total:7.0f} MB in "
                      f"{len(samples[done])} processes  fds {fds:4d}  stream depth {m.get('stream/depth', '-')} "
                      f"credit {m.get('stream/credit', '-')}  committed kept {m.get('stream/committed_kept', '-')}",
                      flush=True)
                next_sample = min((done // args.every + 1) * args.every, args.steps - 1)
                if done >= args.steps - 1:
                    next_sample = args.steps + 1
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
        log.close()
    if proc.returncode != 0:
        raise SystemExit(f"soak: the run exited with {proc.returncode}; its log: {run_dir.parent / 'launch.log'}")
    steps = tail.poll()
    last = max(steps)
    lo, hi = (last // 10, last // 5), (last - last // 10, last)  # 1000 steps: 100-200 and 900-1000
    ratio = {}
    for key in ("timing_s/step", "timing_s/param_sync"):
        first, end = _median_of(steps, key, *lo), _median_of(steps, key, *hi)
        ratio[key] = end / first if first and end is not None else None
    times = {s: m["timing_s/step"] for s, m in steps.items() if s >= 10 and "timing_s/step" in m}
    median = statistics.median(times.values())
    slowest = max(times, key=times.get)
    base = min((s for s in samples if s >= lo[0]), default=min(samples))
    end_sample = max(samples)
    rss = {s: sum(p["rss_mb"] for p in samples[s].values()) for s in (base, end_sample)}
    fds = {s: sum(p["fds"] for p in samples[s].values()) for s in (base, end_sample)}
    growth = {name: samples[end_sample][name]["rss_mb"] / p["rss_mb"] - 1
              for name, p in samples[base].items() if name in samples[end_sample] and p["rss_mb"] > 0}
    worst = max(growth, key=growth.get)
    print(f"per process, step {base} -> {end_sample}:", flush=True)
    for name, p in samples[base].items():
        now = samples[end_sample].get(name, {"rss_mb": float("nan"), "fds": -1})
        print(f"  {name:<40} RSS {p['rss_mb']:7.1f} -> {now['rss_mb']:7.1f} MB  fds {p['fds']:4d} -> {now['fds']:4d}",
              flush=True)
    (run_dir.parent / "soak_samples.json").write_text(json.dumps(samples))
    result = {
        "steps": last, "step_time_ratio": ratio["timing_s/step"], "param_sync_ratio": ratio["timing_s/param_sync"],
        "rss_growth": rss[end_sample] / rss[base] - 1, "fd_growth": fds[end_sample] - fds[base],
        "max_step_vs_median": times[slowest] / median,
        "rss_mb": [rss[base], rss[end_sample]], "rss_growth_worst": [worst, growth[worst]],
        "fds": [fds[base], fds[end_sample]], "sampled_steps": [base, end_sample], "slowest_step": slowest,
        "median_step_s": median, "wall_s": time.monotonic() - t0,
    }
    print(f"steps {lo[0]}-{lo[1]} -> {hi[0]}-{hi[1]}: step time x{ratio['timing_s/step']:.3f}, param_sync "
          f"x{ratio['timing_s/param_sync']:.3f}; RSS {rss[base]:.0f} -> {rss[end_sample]:.0f} MB "
          f"({100 * result['rss_growth']:+.1f}%; most: {worst} {100 * growth[worst]:+.1f}%), fds {fds[base]} -> "
          f"{fds[end_sample]}; slowest step {slowest} {times[slowest]:.3f} s = {result['max_step_vs_median']:.1f}x the "
          f"median {median:.3f} s; load average now {os.getloadavg()[0]:.2f}", flush=True)
    if args.json:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}))
    return result


if __name__ == "__main__":
    main()
