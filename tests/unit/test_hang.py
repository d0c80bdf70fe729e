"""`asyncrl.hang`: the watchdog's deadline from the step times, and naming where a process waits."""

import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.hang import ANSWER_S, WARMUP_STEPS, Watchdog, _waiting_in, dump_stacks, enable_stack_dumps, stacks_dir


def _wait_for(predicate, timeout_s: float = 30.0, what: str = "the condition") -> None:
    """Until ``predicate()`` holds (re-checked every 10 ms); AssertionError after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.01)


def test_the_deadline_is_the_startup_one_then_a_multiple_of_the_steady_median_above_the_floor():
    dog = Watchdog(None, factor=10.0, floor_s=5.0, startup_s=100.0)
    now = 0.0
    for step in range(WARMUP_STEPS + 1):  # start-up and warm-up steps: slow, not counted
        dog.seen(step, now)
        now += 30.0
    assert dog.deadline_s == 100.0 and dog.overdue(now) is None
    for step in range(WARMUP_STEPS + 1, WARMUP_STEPS + 6):
        dog.seen(step, now)
        now += 2.0
    assert dog.deadline_s == 20.0  # 10 x the 2 s median
    assert dog.overdue(now - 2.0 + 19.0) is None and dog.overdue(now - 2.0 + 21.0) == 21.0
    fast = Watchdog(None, factor=10.0, floor_s=5.0, startup_s=100.0)
    for step in range(WARMUP_STEPS + 4):
        fast.seen(step, step * 0.1)
    assert fast.deadline_s == 5.0  # the floor
    assert Watchdog(7.0, 10.0, 5.0, 100.0).deadline_s == 7.0  # watchdog_s given
    # Steps faster than the poll arrive two or three at once: each counts, so the warm-up is over
    # after as many steps as when each was seen (the launcher's poll is 0.5 s; a step can take 0.1 s).
    polled = Watchdog(None, factor=10.0, floor_s=5.0, startup_s=100.0)
    for step, now in ((0, 0.0), (3, 0.5), (5, 1.0), (6, 1.5)):
        polled.seen(step, now)
    assert polled.durations == [0.5 / 3] * 3 + [0.25, 0.25, 0.5] and polled.deadline_s == 5.0


def test_the_waiting_call_is_the_innermost_frame_of_the_thread_in_asyncrl_code():
    dump = ('Thread 0x1 (most recent call first):\n'
            '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n'
            '  File "/usr/lib/python3.11/threading.py", line 982 in run\n\n'
            'Current thread 0x2 (most recent call first):\n'
            '  File "/x/torch/distributed/c10d.py", line 40 in broadcast\n'
            '  File "/x/asyncrl/sync/broadcast.py", line 120 in receive\n')
    assert _waiting_in(dump) == "broadcast (c10d.py:40) via receive (broadcast.py:120)"
    assert _waiting_in(dump.split("\n\n")[0]) == "wait (threading.py:331) (idle)"


def test_sigusr1_writes_this_processes_stacks_to_its_file():
    enable_stack_dumps()
    path = stacks_dir() / f"{os.getpid()}.txt"
    before = path.stat().st_size
    os.kill(os.getpid(), signal.SIGUSR1)
    name = "test_sigusr1_writes_this_processes_stacks_to_its_file"
    _wait_for(lambda: name in path.read_text()[before:], what="this process's stacks in its file")


def test_registering_removes_the_stacks_files_of_processes_gone():
    stacks_dir().mkdir(parents=True, exist_ok=True)
    gone = stacks_dir() / "999999999.txt"  # above any pid Linux hands out (pid_max <= 2**22)
    gone.write_text("an old dump\n")
    enable_stack_dumps._file = None  # register again, as a new process would
    enable_stack_dumps()
    assert not gone.exists() and (stacks_dir() / f"{os.getpid()}.txt").exists()


_CHILD = ("from asyncrl.hang import enable_stack_dumps; enable_stack_dumps(); import time\n"
          "def parked_in_child():\n    time.sleep(600)\n"
          "print('ready', flush=True); parked_in_child()")


@pytest.fixture
def two_children():
    """Two processes that answer SIGUSR1, started by this test (and stopped by it, by pid)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        yield procs
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()


def test_the_dump_waits_for_the_answers_not_a_fixed_time_and_names_a_frozen_process(two_children, tmp_path):
    live, frozen = two_children
    os.kill(frozen.pid, signal.SIGSTOP)
    _wait_for(lambda: open(f"/proc/{frozen.pid}/stat").read().split(") ")[1][0] == "T", what="the child stopped")
    start = time.monotonic()
    path, lines = dump_stacks(tmp_path, reason="test")
    took = time.monotonic() - start
    mine = {int(line.split(" pid ")[1].split(":")[0]): line for line in lines if " pid " in line
            and not line.startswith("launcher")}
    assert "parked_in_child" in mine[live.pid], lines
    assert mine[frozen.pid].endswith("no answer (state stopped): frozen"), lines
    # The live child answers in milliseconds and the frozen one is not waited for.
    assert took < ANSWER_S / 2, took
    assert "parked_in_child" in path.read_text()
