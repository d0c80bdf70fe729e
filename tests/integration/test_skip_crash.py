"""A dump whose writer is SIGKILLed mid-write is not valid and is regenerated.

The writer is a real child process (this file run as a script) that dumps a group with
`DumpStore.write`; it freezes in the ``fsync`` of one file (``data``: the data file's
temporary file, ``meta``: meta.json's, ``dir``: the step directory, inside the commit lock
after both renames), says so on stdout, and the test kills it with SIGKILL by pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from asyncrl.skip import DumpKey, DumpStore, SkipConfig, SkipManager, SkipRoleConfig, is_replayed
from asyncrl.types import Group, Trajectory

KEY = DumpKey(experiment="crash", role="async_rollout", shape={"n": 2})


def make_group(index: int, seed: int) -> Group:
    rng = np.random.default_rng(seed)
    sid = f"sample_0_{index}"
    # Big enough that the data file spans many pages.
    trajs = [Trajectory(sample_id=sid, index=k, prompt_ids=np.arange(1, 5), response_ids=rng.integers(3, 40, 200_000),
                        logprobs=rng.uniform(-3, 0, 200_000).astype(np.float32), versions=np.zeros(200_000, np.int64),
                        finish_reason="length", reward=float(seed)) for k in range(2)]
    return Group(sample_id=sid, trajectories=trajs, expected=2)


def child(root: str, block_at: str, seed: int) -> None:
    real_fsync = os.fsync
    step_dir = str(DumpStore(root, KEY).step_dir(3))

    def fsync(fd):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if (block_at == "dir" and name == step_dir) or Path(name).name.startswith(f".{block_at}."):
            print("BLOCKED", flush=True)
            threading.Event().wait()  # frozen here until the parent's SIGKILL
        real_fsync(fd)

    os.fsync = fsync
    DumpStore(root, KEY).write(3, make_group(3, seed))
    print("DONE", flush=True)


def kill_writer_at(root: Path, block_at: str, seed: int) -> None:
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, __file__, str(root), str(block_at), str(seed)],
                            stdout=subprocess.PIPE, text=True, cwd=repo, env=env)
    try:
        line = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()))
        reader.start()
        reader.join(timeout=60)
        assert line == ["BLOCKED\n"], f"the writer never reached the fsync of {block_at}: {line}"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("block_at", ["data", "meta"])
def test_writer_killed_before_the_commit_leaves_no_valid_dump_and_it_is_regenerated(tmp_path, block_at):
    kill_writer_at(tmp_path, block_at, seed=1)
    store = DumpStore(tmp_path, KEY)
    assert list(store.step_dir(3).glob(".*.tmp"))  # the killed writer's leftovers ...
    assert not (store.step_dir(3) / "meta.json").exists()
    assert not store.valid(3)  # ... are not a dump
    with pytest.raises(FileNotFoundError):
        store.load(3)

    calls = []

    @SkipManager.annotate(role="async_rollout")
    def generate(sample_id: str) -> Group:
        calls.append(sample_id)
        return make_group(3, seed=2)

    SkipManager.init(SkipConfig(experiment="crash", async_rollout=SkipRoleConfig(
        enable=True, dump_dir=str(tmp_path), steps=[3])), shape={"n": 2})
    try:
        fresh = generate("sample_0_3")  # regenerated, and dumped
        replay = generate("sample_0_3")
    finally:
        SkipManager.reset()
    assert calls == ["sample_0_3"]
    assert is_replayed(replay) and not is_replayed(fresh)
    assert replay.trajectories == fresh.trajectories
    assert store.load(3).trajectories == make_group(3, seed=2).trajectories


@pytest.mark.parametrize("block_at", ["data", "meta"])
def test_writer_killed_while_replacing_a_dump_leaves_the_old_one_valid(tmp_path, block_at):
    store = DumpStore(tmp_path, KEY)
    store.write(3, make_group(3, seed=5))
    kill_writer_at(tmp_path, block_at, seed=6)
    assert store.valid(3)
    assert store.load(3) == make_group(3, seed=5)


def test_writer_killed_inside_the_commit_lock_does_not_block_the_next_writer(tmp_path):
    kill_writer_at(tmp_path, "dir", seed=7)  # both renames done: the dump is committed
    store = DumpStore(tmp_path, KEY)
    assert store.load(3) == make_group(3, seed=7)
    store.write(3, make_group(3, seed=8))  # the kernel released the dead writer's lock
    assert store.load(3) == make_group(3, seed=8)


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
