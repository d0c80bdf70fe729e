"""The generic codec's recycled pool buffers over real ZeroMQ sockets (zero-copy sends)."""

from __future__ import annotations

import numpy as np

from asyncrl.queue.codec import PoolBuffers, pack, unpack
from asyncrl.types import Group, Trajectory


def _traj(sid: str, k: int, n_prompt: int, n_resp: int, reward: float = 0.5) -> Trajectory:
    rng = np.random.default_rng(k)
    return Trajectory(
        sample_id=sid, index=k, prompt_ids=rng.integers(0, 50_000, n_prompt), response_ids=rng.integers(0, 50_000, n_resp),
        logprobs=-rng.random(n_resp, dtype=np.float32), versions=np.full(n_resp, 3), finish_reason="length" if k else "stop",
        reward=reward, age=k % 2,
    )


def test_recycled_pools_in_flight_through_zeromq_are_never_overwritten():
    # Many distinct groups packed into recycled buffers and sent zero-copy before the receiver
    # reads any of them: every one must arrive as it was packed.
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        buffers = PoolBuffers(keep=4)
        # ~100 KB pools: over pyzmq's copy threshold, so they really travel zero-copy.
        groups = [Group(f"sample_0_{i}", [_traj(f"sample_0_{i}", k, 7 + i, 1600 + i) for k in range(3)], expected=3)
                  for i in range(64)]
        assert all(memoryview(pack(g)[1]).nbytes > zmq.COPY_THRESHOLD for g in groups)
        for g in groups:
            push.send_multipart(pack(g, buffers=buffers), copy=False)
        for g in groups:
            assert unpack(pull.recv_multipart(copy=False)) == g
        assert len(buffers._buffers) == 4
    finally:
        push.close(linger=0), pull.close(linger=0)
        ctx.term()
