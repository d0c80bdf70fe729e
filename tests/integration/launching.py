"""`Launch`: one ``python -m asyncrl.launch`` in its own session, its output read line by line as it
runs, so a test can act at a step (kill an actor by pid, send Ctrl-C) and then wait for what follows.

Actors are found among the launcher's own descendants (``ray::<Class>`` process titles) and
killed by pid.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import torch

from asyncrl.types import CommittedSet, parse_sample_id

ROOT = Path(__file__).resolve().parents[2]
T = 600.0  # deadline of any one wait (the shared CI machine starts Ray slowly)


class Launch:
    """One ``python -m asyncrl.launch`` process in its own session; its output read by a thread."""

    def __init__(self, *args: str, cwd: Path = ROOT):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", "asyncrl.launch", *args], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_line(self, prefix: str) -> str:
        """The next line of output starting with ``prefix`` (earlier lines are passed over)."""
        while True:
            try:
                line = self._queue.get(timeout=T)
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} within {T}s:\n{self.output[-3000:]}") from None
            if line is None:
                raise AssertionError(f"the launcher exited before {prefix!r}:\n{self.output[-3000:]}")
            if line.startswith(prefix):
                return line

    def wait_step(self, step: int) -> None:
        self.wait_line(f"step {step:3d}/")

    def restored_step(self) -> int:
        """The step a resumed launcher restored (from its 'resumed at step N, ...' line)."""
        return int(self.wait_line("asyncrl: resumed at step ").split()[4].rstrip(","))

    def actor_pids(self, cls: str) -> list[int]:
        out = []
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if p.cmdline() and p.cmdline()[0].startswith(f"ray::{cls}"):
                    out.append(p.pid)
            except psutil.Error:
                pass
        assert out, f"no ray::{cls} process under the launcher"
        return out

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=T)
        finally:
            self.kill_all()

    def kill_all(self) -> list[psutil.Process]:
        """SIGKILL the launcher, then every process under it still there after 60 s (by pid); returns those."""
        try:
            family = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            family = []
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        _, alive = psutil.wait_procs(family, timeout=60)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=30)
        return alive

    @property
    def output(self) -> str:
        return "".join(self.lines)


# The whole-run crash tests' shared run (test_resume.py, test_restarts.py) and checks.

STEPS, GROUPS = 14, 2
COMMON = ["--steps", str(STEPS), "--n", "2", "--groups-per-step", str(GROUPS), "--max-tokens", "3",
          "--lr", "1e-3", "--sync-every", "1", "--staleness-threshold", "0", "--engines", "2", "--seed", "3",
          "trainer.checkpoint_every=2", "--max-restarts", "0"]  # each death stops the run (restarts: below)


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ckpt = run_dir / "checkpoints"
    out = run_dir / "final.pt"
    dcp_to_torch_save(ckpt / (ckpt / "latest").read_text().strip(), out)
    return torch.load(out, weights_only=False)["model"]


def sidecar(run_dir: Path) -> dict:
    ckpt = run_dir / "checkpoints"
    return json.loads((ckpt / (ckpt / "latest").read_text().strip() / "trainer_state.json").read_text())


def check_exactly_once(run_dir: Path, steps: int = STEPS, groups: int = GROUPS) -> None:
    """samples.jsonl names each id once, exactly the final checkpoint's committed set, every step
    trained; every feed index below ``next_index`` trained, dropped with a reason, or pending."""
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    ids = [r["sample_id"] for r in records]
    assert len(ids) == len(set(ids)), "a sample_id is listed twice"
    state = sidecar(run_dir)
    assert state["step"] == steps
    committed = CommittedSet.from_json(state["committed"])
    assert committed == set(ids)
    assert all(r["reason"] for r in records if r["status"] == "dropped")
    trained = [r for r in records if r["status"] == "trained"]
    assert sorted(r["step"] for r in trained) == sorted(s for s in range(1, steps + 1) for _ in range(groups))
    feed = state["rollouter_state"]
    done = {parse_sample_id(sid)[1] for sid in ids}
    pending = {parse_sample_id(sid)[1] for sid in feed["in_flight"] + feed["unacked"]}
    assert set(range(feed["next_index"])) <= done | pending  # trained, dropped, or still pending
    assert max(done | pending) < feed["next_index"]
