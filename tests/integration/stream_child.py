"""Child processes of the stream integration tests: a producer and a committing consumer.

    python stream_child.py produce ENDPOINT --producer-id a --epoch 0 --count 500
    python stream_child.py consume ENDPOINT --log committed.txt --expect 1000 --batch 4

The producer sends groups ``sample_{epoch}_{i}`` whose token arrays are a function of the id,
prints ``sent <i>`` after each send, waits until all are acked and prints its stats as JSON.
Both print ``event: <message>`` for every warning the stream logs (e.g. the producer's
"consumer silent" once ``peer_timeout_s`` passed without credit), so tests wait on those.
The consumer "trains" in batches: it appends the batch's sample_ids to ``--log`` (one write
and an fsync: that is the commit) and only then acks. On start it reads the log back as its
committed set, dropping a torn last line, so it can be killed with SIGKILL and restarted.
It checks every group's arrays and prints its stats as JSON when ``--expect`` ids are committed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict

import numpy as np

from asyncrl.queue import BlockingStreamConsumer, BlockingStreamProducer, StreamConfig, StreamTimeout
from asyncrl.types import Group, Trajectory, parse_sample_id


def make_group(sample_id: str, n: int, tokens: int) -> Group:
    _, i = parse_sample_id(sample_id)
    trajs = [
        Trajectory(sample_id, k, np.arange(16) + i, np.full(tokens, i * 10 + k), np.full(tokens, -k / 8, np.float32),
                   np.full(tokens, i % 7), "stop", reward=float(k))
        for k in range(n)
    ]
    return Group(sample_id, trajs, expected=n)


def group_is_intact(g: Group) -> bool:
    ref = make_group(g.sample_id, len(g.trajectories), len(g.trajectories[0].response_ids) if g.trajectories else 0)
    return g == ref


def _config(args: argparse.Namespace) -> StreamConfig:
    return StreamConfig(endpoint=args.endpoint, window=args.window, heartbeat_s=0.1, peer_timeout_s=1.0)


def produce(args: argparse.Namespace) -> None:
    producer = BlockingStreamProducer(_config(args), producer_id=args.producer_id)
    producer.start()
    for i in range(args.count):
        producer.send(make_group(f"sample_{args.epoch}_{i}", args.n, args.tokens))
        print(f"sent {i + 1}", flush=True)
    producer.wait_acked(timeout=120)
    print(json.dumps(asdict(producer.stats)), flush=True)
    producer.close()


def recover(log_path: str) -> list[str]:
    """The committed ids in the log; a torn last line (killed mid-write) is cut off."""
    if not os.path.exists(log_path):
        return []
    with open(log_path, "rb") as f:
        data = f.read()
    keep = data[: data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        with open(log_path, "r+b") as f:
            f.truncate(len(keep))
    return keep.decode().split()


def consume(args: argparse.Namespace) -> None:
    committed = set(recover(args.log))
    consumer = BlockingStreamConsumer(_config(args), committed=committed)
    consumer.start()
    fd = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    bad = 0
    while len(committed) < args.expect:
        batch = [consumer.recv(timeout=120)]
        while len(batch) < args.batch and len(committed) + len(batch) < args.expect:
            try:
                batch.append(consumer.recv(timeout=0.2))
            except StreamTimeout:
                break
        bad += sum(not group_is_intact(g) for g in batch)
        ids = [g.sample_id for g in batch]
        os.write(fd, "".join(s + "\n" for s in ids).encode())  # the step's commit record
        os.fsync(fd)
        consumer.ack(ids)
        committed.update(ids)
    os.close(fd)
    stats = asdict(consumer.stats)
    consumer.close()
    print(json.dumps({**stats, "bad_payload": bad}), flush=True)


class _PrintEvents(logging.Handler):
    """Stream warnings as ``event: ...`` lines on stdout, where the test reads them."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"event: {record.getMessage()}", flush=True)


def main() -> None:
    handler = _PrintEvents(level=logging.WARNING)
    logging.getLogger("asyncrl.queue").addHandler(handler)
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["produce", "consume"])
    parser.add_argument("endpoint")
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--producer-id", default="p")
    parser.add_argument("--epoch", type=int, default=0)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--log", default="committed.txt")
    parser.add_argument("--expect", type=int, default=100)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    produce(args) if args.role == "produce" else consume(args)


if __name__ == "__main__":
    sys.exit(main())
