"""The hang watchdog: when no train step completes for too long, say where every process waits.

A run that hangs says nothing by itself: users of other systems report runs stuck for hours with
no word of where. Each process of a run (`enable_stack_dumps`, called by every actor as it
starts) answers SIGUSR1 by writing the stacks of all its threads to ``<tmp>/asyncrl-stacks/<pid>.txt``
(`faulthandler`: written from the signal handler in C, so a process stuck inside a C call, a
collective or a lock still answers). `Watchdog` follows the Trainer's step; past its deadline
`dump_stacks` signals every process under the launcher, writes ``<run_dir>/hang-<time>.txt``
(every process's stacks, the launcher's own and its asyncio tasks' included) and returns one line
per process naming the call it waits in; a process that does not answer is named with its state
(``stopped``: frozen by SIGSTOP or a debugger). The launcher then stops the run and starts it
again from its last checkpoint (``max_restarts``).

The deadline: ``watchdog_s`` when set; otherwise ``watchdog_factor`` x the median step time of
the steps after the first ``WARMUP_STEPS``, never below ``watchdog_floor_s``; until such steps
exist (the first steps: first generation, compilation), ``watchdog_startup_s``. Leaves out: processes on other nodes (they are not under
the launcher; their stacks need `ray stack` there).
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

WARMUP_STEPS = 3
"""Steps left out of the median that sets the deadline (start-up, first compilation)."""
ANSWER_S = 10.0
"""Deadline of the processes' answers in `dump_stacks` (a live one answers in milliseconds; on a
loaded machine it may wait its turn for a core). A frozen one is not waited for."""
POLL_S = 0.02


def stacks_dir() -> Path:
    return Path(tempfile.gettempdir()) / "asyncrl-stacks"


def enable_stack_dumps() -> None:
    """Write this process's thread stacks to ``stacks_dir()/<pid>.txt`` on SIGUSR1 (idempotent)."""
    if getattr(enable_stack_dumps, "_file", None) is not None:
        return
    stacks_dir().mkdir(parents=True, exist_ok=True)
    for old in stacks_dir().glob("*.txt"):  # files of processes gone (killed ones leave theirs)
        if old.stem.isdigit() and not _alive(int(old.stem)):
            old.unlink(missing_ok=True)
    f = open(stacks_dir() / f"{os.getpid()}.txt", "w")  # noqa: SIM115 - kept open for the handler
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
    enable_stack_dumps._file = f


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class Watchdog:
    """The deadline of the next step, from the steps seen so far (see the module doc)."""

    def __init__(self, watchdog_s: float | None, factor: float, floor_s: float, startup_s: float) -> None:
        self.fixed, self.factor, self.floor_s, self.startup_s = watchdog_s, factor, floor_s, startup_s
        self.durations: list[float] = []
        self.step: int | None = None
        self.since = time.monotonic()

    def seen(self, step: int, now: float | None = None) -> None:
        """The Trainer is at ``step``; a new one restarts the clock. Steps faster than the poll
        arrive several at once: each of them counts, with an equal share of the time."""
        now = time.monotonic() if now is None else now
        if step != self.step:
            if self.step is not None:
                advanced = max(1, step - self.step)
                self.durations.extend([(now - self.since) / advanced] * advanced)
            self.step, self.since = step, now

    @property
    def deadline_s(self) -> float:
        if self.fixed is not None:
            return self.fixed
        steady = self.durations[WARMUP_STEPS:]
        return max(self.floor_s, self.factor * statistics.median(steady)) if steady else self.startup_s

    def overdue(self, now: float | None = None) -> float | None:
        """Seconds since the last step if past the deadline, else None."""
        waited = (time.monotonic() if now is None else now) - self.since
        return waited if waited > self.deadline_s else None


def dump_stacks(run_dir: Path, root_pid: int | None = None, reason: str = "") -> tuple[Path, list[str]]:
    """Every process under ``root_pid`` (default: this one) and itself: their stacks into
    ``run_dir/hang-<time>.txt``; returns the file and one line per process."""
    import psutil

    root = psutil.Process(root_pid or os.getpid())
    # Only processes that registered the handler (their stacks file is newer than they are): the
    # default action of SIGUSR1 ends a process, and Ray's own agents do not handle it.
    others, titles, marks = [], {}, {}
    for p in root.children(recursive=True):
        path = stacks_dir() / f"{p.pid}.txt"
        try:
            if path.exists() and path.stat().st_mtime >= p.create_time() - 1:
                titles[p.pid], marks[p.pid] = _title(p), path.stat().st_size
                others.append(p)
        except psutil.Error:
            continue
    for p in others:
        try:
            p.send_signal(signal.SIGUSR1)
        except psutil.Error:
            pass
    _await_answers(others, marks, ANSWER_S)
    sections, lines = [], []
    own = _own_stacks()
    sections.append((f"{_title(root)} (pid {root.pid}, the launcher)", own))
    lines.append(f"launcher pid {root.pid}: {_waiting_in_python()}")
    for p in others:
        title, path = titles[p.pid].split(".")[0], stacks_dir() / f"{p.pid}.txt"
        text = ""
        if path.exists() and path.stat().st_size > marks[p.pid]:
            with open(path) as f:
                f.seek(marks[p.pid])
                text = f.read()
        if text:
            sections.append((f"{title} (pid {p.pid})", text))
            lines.append(f"{title} pid {p.pid}: {_waiting_in(text)}")
        else:
            try:
                state = p.status()
            except psutil.Error:
                state = "gone"
            sections.append((f"{title} (pid {p.pid})", f"no answer within {ANSWER_S:g} s (process state: {state})\n"))
            lines.append(f"{title} pid {p.pid}: no answer (state {state})" + (": frozen" if state == "stopped" else ""))
    out = Path(run_dir) / f"hang-{time.strftime('%Y%m%d-%H%M%S')}.txt"
    with open(out, "w") as f:
        f.write(f"{reason}\n\n" + "\n".join(lines) + "\n")
        for head, text in sections:
            f.write(f"\n===== {head}\n{text}")
    return out, lines


def _await_answers(procs: list, marks: dict[int, int], deadline_s: float) -> None:
    """Until each of ``procs`` has written its stacks (its file grew past ``marks`` and then held
    still for one poll: the handler writes in several calls), is frozen or gone, or the deadline."""
    import psutil

    def size(p) -> int:
        try:
            return (stacks_dir() / f"{p.pid}.txt").stat().st_size
        except OSError:
            return 0

    def silent(p) -> bool:  # will not answer: stopped (SIGSTOP, a debugger), a zombie, or gone
        try:
            return p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return True

    end = time.monotonic() + deadline_s
    last = {p.pid: -1 for p in procs}
    waiting = list(procs)
    while waiting and time.monotonic() < end:
        now = {p.pid: size(p) for p in waiting}
        waiting = [p for p in waiting if not (now[p.pid] > marks[p.pid] and now[p.pid] == last[p.pid]) and not silent(p)]
        last.update(now)
        if waiting:
            time.sleep(POLL_S)


def _title(p) -> str:
    try:
        return (p.cmdline() or [p.name()])[0]
    except Exception:  # noqa: BLE001 - gone or not ours
        return "?"


def _own_stacks() -> str:
    """This process's threads and, when called from its event loop, its asyncio tasks."""
    out = []
    for tid, frame in sys._current_frames().items():
        out.append(f"Thread {tid:#x}:\n" + "".join(traceback.format_stack(frame)))
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:
        tasks = set()
    for task in tasks:
        stack = task.get_stack(limit=8)
        where = "".join(traceback.format_list(traceback.extract_stack(stack[-1]))[-2:]) if stack else "  (not started)\n"
        out.append(f"Task {task.get_name()} {task.get_coro()!r}:\n{where}")
    return "\n".join(out) + "\n"


def _waiting_in_python() -> str:
    try:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    except RuntimeError:
        return "not in an event loop"
    names = sorted({getattr(t.get_coro(), "__qualname__", str(t.get_coro())) for t in tasks})
    return "awaiting " + ", ".join(names[:4]) + (f" (+{len(names) - 4})" if len(names) > 4 else "")


def _waiting_in(text: str) -> str:
    """Where a process waits, from its `faulthandler` dump: the innermost frame of the thread that
    runs asyncrl code (with that asyncrl frame when the innermost is a library's), ``func (file:line)``;
    a process with no thread in asyncrl code: its first thread's innermost frame, "(idle)"."""
    first = None
    for block in text.split("\n\n"):
        frames = [line.strip() for line in block.splitlines() if line.strip().startswith("File ")]
        if not frames:
            continue
        first = first or frames[0]  # faulthandler lists the most recent call first
        ours = [f for f in frames if "/asyncrl/" in f]
        if ours:
            where = _frame(frames[0])
            return where if frames[0] == ours[0] else f"{where} via {_frame(ours[0])}"
    return f"{_frame(first)} (idle)" if first else "no Python frame"


def _frame(line: str) -> str:
    # 'File "/x/y.py", line 12 in func'
    try:
        path = line.split('"')[1]
        rest = line.split('"')[2]
        lineno = rest.split("line")[1].split()[0]
        func = rest.split(" in ")[-1]
        return f"{func} ({Path(path).name}:{lineno})"
    except IndexError:
        return line


class HangError(RuntimeError):
    """No train step completed within the watchdog's deadline (the stacks are in the named file)."""


async def watch(trainer, run_dir: Path, watchdog: Watchdog, poll_s: float = 0.5) -> HangError:
    """Follow ``trainer.step``; past the deadline dump every process's stacks and return the error."""
    while True:
        await asyncio.sleep(poll_s)
        watchdog.seen(trainer.step)
        waited = watchdog.overdue()
        if waited is None:
            continue
        reason = (f"no train step completed for {waited:.0f} s (deadline {watchdog.deadline_s:.0f} s) after step "
                  f"{trainer.step}")
        path, lines = dump_stacks(run_dir, reason=reason)
        print(f"asyncrl: hang: {reason}; every process's stacks in {path}:\n" + "\n".join(f"  {x}" for x in lines),
              file=sys.stderr, flush=True)
        return HangError(f"{reason}; stacks in {path}; " + "; ".join(lines))
