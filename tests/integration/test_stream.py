"""The sample stream across real processes (see stream_child.py for the children).

Two producers into one consumer; a stopped consumer (SIGSTOP) and a producer that blocks at
the window with flat memory; a consumer killed with SIGKILL and restarted (every group
committed exactly once); a producer killed and restarted; garbage injected on the socket.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import zmq

from asyncrl.net import free_port

CHILD = Path(__file__).with_name("stream_child.py")


class Child:
    """A child process whose stdout lines are collected by a reader thread."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.strip())
                self._changed.notify_all()

    def sent(self) -> int:
        return sum(1 for line in self.lines if line.startswith("sent "))

    def saw(self, text: str) -> bool:
        """Whether the child printed an ``event:`` line containing ``text``."""
        return any(line.startswith("event: ") and text in line for line in self.lines)

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: predicate() or self.proc.poll() is not None, timeout):
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            if not predicate():
                raise AssertionError(f"child exited ({self.proc.returncode}) before {what}: {self.proc.stderr.read()[-2000:]}")

    def result(self, timeout: float = 120) -> dict:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        assert rc == 0, self.proc.stderr.read()[-3000:]
        return json.loads(self.lines[-1])

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            if sig == signal.SIGKILL:
                self.proc.wait(timeout=30)


@pytest.fixture
def spawn():
    children: list[Child] = []

    def start(*args: str) -> Child:
        child = Child(*args)
        children.append(child)
        return child

    yield start
    for child in children:  # stop only what this test started, by pid, and reap it
        if child.proc.poll() is None:
            os.kill(child.proc.pid, signal.SIGCONT)
            child.kill()
        child.proc.wait(timeout=30)


@pytest.fixture
def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def _committed_ids(log: Path) -> list[str]:
    return log.read_text().split()


def _wait_lines(log: Path, at_least: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (log.exists() and len(_committed_ids(log)) >= at_least):
        if time.monotonic() > deadline:
            raise AssertionError(f"the consumer committed fewer than {at_least} groups within {timeout}s")
        time.sleep(0.02)


def test_two_producers_500_groups_each_arrive_once(spawn, endpoint, tmp_path):
    log = tmp_path / "committed.txt"
    consumer = spawn("consume", endpoint, "--log", str(log), "--expect", "1000", "--batch", "8", "--window", "16")
    a = spawn("produce", endpoint, "--producer-id", "a", "--epoch", "0", "--count", "500", "--window", "16")
    b = spawn("produce", endpoint, "--producer-id", "b", "--epoch", "1", "--count", "500", "--window", "16")
    stats = consumer.result()
    assert a.result()["acked"] == 500 and b.result()["acked"] == 500
    ids = _committed_ids(log)
    assert Counter(ids) == Counter([f"sample_{e}_{i}" for e in (0, 1) for i in range(500)])
    assert stats["delivered"] == 1000 and stats["duplicates"] == 0 and stats["bad_payload"] == 0


def test_stopped_consumer_blocks_the_producer_at_the_window_with_flat_memory(spawn, endpoint, tmp_path):
    log = tmp_path / "committed.txt"
    window = 4
    consumer = spawn("consume", endpoint, "--log", str(log), "--expect", "60", "--batch", "2", "--window", str(window))
    # ~1 MB groups: without credit, 60 of them would grow the producer by ~60 MB.
    producer = spawn("produce", endpoint, "--count", "60", "--n", "8", "--tokens", "6000", "--window", str(window))
    producer.wait_for(lambda: producer.sent() >= 10, 60, "the first groups to flow")
    os.kill(consumer.proc.pid, signal.SIGSTOP)
    try:
        rss = psutil.Process(producer.proc.pid).memory_info().rss
        # The producer hears nothing for peer_timeout_s and says so: by then it has used every
        # credit it had, and a producer that ignored credit would have sent far beyond it.
        producer.wait_for(lambda: producer.saw("consumer silent"), 60, "the producer to find the consumer silent")
        # Credit is the groups the consumer finished (all committed to its log first) plus the window.
        assert producer.sent() <= len(_committed_ids(log)) + window, "the producer sent without credit"
        assert producer.proc.poll() is None, "the producer gave up instead of waiting"
        # Since the stop it may have built at most a window of ~1 MB groups (8 MB of slack for the
        # rest); sending without credit would have added ~50 MB.
        assert psutil.Process(producer.proc.pid).memory_info().rss - rss < (8 + window) * 1024 * 1024
    finally:
        os.kill(consumer.proc.pid, signal.SIGCONT)
    assert producer.result()["acked"] == 60
    assert consumer.result()["bad_payload"] == 0
    assert Counter(_committed_ids(log)) == Counter(f"sample_0_{i}" for i in range(60))


def test_consumer_killed_with_sigkill_and_restarted_commits_every_group_exactly_once(spawn, endpoint, tmp_path):
    log = tmp_path / "committed.txt"
    count = 400
    args = ("consume", endpoint, "--log", str(log), "--expect", str(count), "--batch", "4", "--window", "8")
    first = spawn(*args)
    producer = spawn("produce", endpoint, "--count", str(count), "--window", "8")
    _wait_lines(log, 100, timeout=60)
    first.kill(signal.SIGKILL)  # mid-stream: groups in flight, some received and not committed
    assert first.proc.returncode == -signal.SIGKILL
    killed_at = len(_committed_ids(log))
    assert killed_at < count
    second = spawn(*args)
    stats = second.result()
    producer_stats = producer.result()
    ids = _committed_ids(log)
    assert len(ids) == count and set(ids) == {f"sample_0_{i}" for i in range(count)}  # none lost, none twice
    assert stats["bad_payload"] == 0 and stats["delivered"] == count - killed_at
    assert producer_stats["sessions"] == 2 and producer_stats["acked"] == count


def test_producer_killed_and_restarted_resumes_without_confusing_the_consumer(spawn, endpoint, tmp_path):
    log = tmp_path / "committed.txt"
    count = 300
    consumer = spawn("consume", endpoint, "--log", str(log), "--expect", str(count), "--batch", "4", "--window", "8")
    first = spawn("produce", endpoint, "--producer-id", "a", "--count", str(count), "--window", "8")
    first.wait_for(lambda: first.sent() >= 80, 60, "80 groups sent")
    first.kill(signal.SIGKILL)
    # The restarted producer lost its state and regenerates from the start: the consumer acks
    # what it committed at once and delivers only the rest.
    second = spawn("produce", endpoint, "--producer-id", "a", "--count", str(count), "--window", "8")
    assert second.result()["acked"] == count
    stats = consumer.result()
    ids = _committed_ids(log)
    assert Counter(ids) == Counter(f"sample_0_{i}" for i in range(count))
    assert stats["delivered"] == count and stats["duplicates"] >= 70 and stats["bad_payload"] == 0


def test_garbage_on_the_socket_does_not_stop_delivery(spawn, endpoint, tmp_path):
    log = tmp_path / "committed.txt"
    consumer = spawn("consume", endpoint, "--log", str(log), "--expect", "200", "--batch", "4")
    producer = spawn("produce", endpoint, "--count", "200")
    producer.wait_for(lambda: producer.sent() >= 20, 60, "the first groups to flow")
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 2000)
    rogue.connect(endpoint)
    host, port = endpoint.removeprefix("tcp://").split(":")
    try:
        for i in range(30):
            rogue.send_multipart([os.urandom(40 + i), os.urandom(3)])
        rogue.send_multipart([b""])
        with socket.create_connection((host, int(port))) as raw:  # not even ZeroMQ
            raw.sendall(os.urandom(4096))
    finally:
        rogue.close()
        ctx.term()
    stats = consumer.result()
    assert producer.result()["acked"] == 200
    # 31 from the DEALER; raw bytes may also parse as legacy ZMTP/1.0 frames and count too.
    assert stats["malformed"] >= 31 and stats["delivered"] == 200 and stats["bad_payload"] == 0
    assert Counter(_committed_ids(log)) == Counter(f"sample_0_{i}" for i in range(200))
