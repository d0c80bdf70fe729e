"""Throughput of the sample stream against two baselines, measured in one run on this machine.

    python scripts/bench_stream.py            # a table
    python scripts/bench_stream.py --json     # ... and, as the last line, one JSON object

Groups of n=8 trajectories with 1k and with 8k response tokens (prompt_ids, response_ids,
logprobs, versions arrays) go from one process to another through:

(a) ``stream``: asyncrl's StreamProducer -> StreamConsumer, end to end: encode, credit, decode
    into Group records, and an ack per group from the consumer;
(b) ``raw_zmq``: ZeroMQ PUSH -> PULL re-sending one group's pre-encoded frames, one group per
    message (the same bytes as (a)'s payload) with no encode, decode, credit or acks: the
    physical limit of sending groups one by one, the baseline of the targets. Its processes and
    sockets get the settings (a)'s get (`StreamConfig.keep_freed_memory` and
    ``socket_buffer_bytes``, which speed raw ZeroMQ up as much), so the ratio measures the
    stream's own work; ``raw_zmq_untuned`` is the same with glibc's and ZeroMQ's defaults;
(b2) ``raw_zmq_batched``: the same, but each message carries as many groups as (a)'s messages
    held on average in the same run (the stream lets groups waiting to leave share a message):
    the physical limit for (a)'s own framing, shown beside (b) so that (a)'s batching is not
    mistaken for a faster wire;
(b3) ``raw_zmq_gather``: (b), but each message's pool frame joined afresh from the group's own
    arrays (one copy of its bytes, as any sender of groups it has just made must do; still no
    encode, credit or acks): (b) re-sends one buffer that stays in the cache and copies nothing,
    which no producer of new groups can do, so (a) against (b3) is the stream's own cost;
(c) ``ray_queue``: a Ray actor queue receiving cloudpickled groups through actor calls from a
    producer actor, drained by a consumer actor that unpickles them (the design of verl's
    fully-async MessageQueue).

MB/s counts the groups' array bytes. Each figure is taken at the receiver, from the
``--warmup``-th group to the last, so connection set-up and the first window are left out.
Groups are built before the clock starts. Each case runs ``--repeats`` (5) times per codec as
stream, raw, stream, raw, ...; each run's ratio is the stream's rate over the raw rate taken
right after it, and the median of those ratios counts, with its spread (a shared machine moves
a path by 30% between minutes: one run proves nothing). Both codecs run: ``accel`` (the C
extension ``asyncrl/queue/_fastgroups``) and ``python`` (``ASYNCRL_PURE_PYTHON=1``); the
batched, untuned and gather raw baselines run after each pair of the first codec only
(``vs_zmq_gather_median`` etc. in the JSON).

Every run is printed with the 1-minute load average beside it, then the medians; with
``--json`` the last line holds ``vs_raw_median``, ``vs_raw_min``, ``vs_raw_max`` (1k, C),
the same with ``_8k`` for the 8k case and ``_py`` for the pure-Python codec, each run's ratio
(``vs_raw_runs*``), the date, the CPU count and the load averages at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from asyncrl.net import free_port

os.environ.setdefault("OMP_NUM_THREADS", "1")

N_RESPONSES = 8
PROMPT_TOKENS = 256
ENDPOINT = "tcp://127.0.0.1:{port}"


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--groups-1k", type=int, default=6000, help="groups sent in the 1k-token case (stream and raw)")
    p.add_argument("--groups-8k", type=int, default=1200, help="groups sent in the 8k-token case (stream and raw)")
    p.add_argument("--ray-fraction", type=float, default=0.25, help="fraction of those groups for the (slow) Ray queue")
    p.add_argument("--warmup", type=int, default=100, help="groups received before the clock starts")
    p.add_argument("--window", type=int, default=64, help="StreamConfig.window of the stream")
    p.add_argument("--skip-ray", action="store_true", help="leave out the Ray baseline")
    p.add_argument("--cases", default="1k,8k", help="comma-separated subset of 1k,8k")
    p.add_argument("--repeats", "--repeat", dest="repeats", type=int, default=5,
                   help="runs of each case and codec, stream and raw alternating; the median counts")
    p.add_argument("--codecs", default="accel,python",
                   help="comma-separated: accel (the C extension), python (ASYNCRL_PURE_PYTHON=1)")
    return p.parse_args()


# ---------------------------------------------------------------------------------- workload


def _arrays(tokens: int, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, 150_000, PROMPT_TOKENS), rng.integers(0, 150_000, tokens),
         -rng.random(tokens, dtype=np.float32), np.full(tokens, seed % 5, dtype=np.int64))
        for _ in range(N_RESPONSES)
    ]


def make_group(i: int, arrays):
    """Group ``sample_0_{i}`` over shared arrays: building one costs what a Rollouter's would."""
    from asyncrl.types import Group, Trajectory

    sid = f"sample_0_{i}"
    return Group(sid, [Trajectory(sid, k, *a, "stop", reward=1.0) for k, a in enumerate(arrays)], N_RESPONSES)


def group_nbytes(tokens: int) -> int:
    return sum(a.nbytes for t in _arrays(tokens, 0) for a in t)


def _cpu_s() -> float:
    """CPU seconds of this process so far, every thread (ZeroMQ's I/O thread too), user + system."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rate(times: list[float], warmup: int) -> float:
    """Groups per second between the warmup-th and the last receive."""
    return (len(times) - 1 - warmup) / (times[-1] - times[warmup])


# ---------------------------------------------------------------------------------- (a) stream


def _stream_producer(port: int, tokens: int, count: int, window: int, out) -> None:
    import asyncio

    from asyncrl.queue import StreamConfig, StreamProducer

    async def run() -> None:
        arrays = _arrays(tokens, 1)
        groups = [make_group(i, arrays) for i in range(count)]  # built before the clock, as for (c)
        cpu = _cpu_s()
        async with StreamProducer(StreamConfig(endpoint=ENDPOINT.format(port=port), window=window), producer_id="bench") as p:
            for g in groups:
                await p.send(g)
            await p.wait_acked(timeout=120)
        out.put(("producer_cpu", (_cpu_s() - cpu) / count))

    asyncio.run(run())


def _stream_consumer(port: int, count: int, window: int, out) -> None:
    import asyncio

    from asyncrl.queue import StreamConfig, StreamConsumer, group_codec

    async def run() -> tuple[list[float], float, bool, float]:
        times = []
        async with StreamConsumer(StreamConfig(endpoint=ENDPOINT.format(port=port), window=window)) as c:
            out.put("ready")
            for i in range(count):
                g = await c.recv(timeout=120)
                c.ack([g.sample_id])
                times.append(time.monotonic())
                if i == 0:
                    cpu = _cpu_s()
            cpu = (_cpu_s() - cpu) / (count - 1)
            assert len(g.trajectories) == N_RESPONSES
            return times, c.stats.received / c.stats.messages, group_codec._fast is not None, cpu

    out.put(asyncio.run(run()))


# ---------------------------------------------------------------------------------- (b) raw zmq


def _tune(sock, tuned: bool) -> None:
    """Give a raw socket's process and socket the settings the stream's get, when ``tuned``."""
    import zmq

    from asyncrl.queue import StreamConfig
    from asyncrl.queue.transport import keep_freed_memory

    if tuned:
        keep_freed_memory()  # StreamConfig.keep_freed_memory
        sock.setsockopt(zmq.SNDBUF, StreamConfig.socket_buffer_bytes)
        sock.setsockopt(zmq.RCVBUF, StreamConfig.socket_buffer_bytes)


def _raw_producer(port: int, tokens: int, messages: int, per_message: int, tuned: bool, gather: bool, out) -> None:
    import zmq

    from asyncrl.queue.group_codec import pack_groups, prepare_group

    arrays = _arrays(tokens, 1)
    prepared = [prepare_group(make_group(i, arrays)) for i in range(per_message)]
    frames = pack_groups(prepared)
    # gather: the pool frame joined afresh from the groups' own arrays for every message, as a
    # sender of groups it has just made must (the same bytes; no encode, credit or acks)
    parts = [a for g in prepared for column in g.sources for a in column]
    cpu = _cpu_s()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    _tune(sock, tuned)
    sock.connect(ENDPOINT.format(port=port))
    for _ in range(messages):
        sock.send_multipart([frames[0], b"".join(parts)] if gather else frames, copy=False)
    sock.close(linger=-1)
    ctx.term()  # returns once every queued message went out
    out.put(("producer_cpu", (_cpu_s() - cpu) / (messages * per_message)))


def _raw_consumer(port: int, messages: int, tuned: bool, out) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.PULL)
    _tune(sock, tuned)
    sock.bind(ENDPOINT.format(port=port))
    out.put("ready")
    times = []
    for i in range(messages):
        sock.recv_multipart(copy=False)
        times.append(time.monotonic())
        if i == 0:
            cpu = _cpu_s()
    cpu = (_cpu_s() - cpu) / (messages - 1)
    sock.close()
    out.put((times, cpu))


def _raw_rate(tokens: int, count: int, warmup: int, per_message: int, tuned: bool = True,
              gather: bool = False) -> tuple[float, float, float]:
    """Groups per second of raw ZeroMQ carrying ``count`` groups, ``per_message`` to a message
    (``gather``: each message's pool joined afresh from the arrays), and the CPU seconds per
    group of its producer and of its consumer."""
    messages = max(count // per_message, warmup // per_message + 10)
    port = free_port()
    (times, consumer_cpu), producer_cpu = _run_pair(
        _raw_producer, _raw_consumer, (port, tokens, messages, per_message, tuned, gather), (port, messages, tuned)
    )
    return per_message * _rate(times, warmup // per_message), producer_cpu, consumer_cpu / per_message


def _run_pair(producer, consumer, producer_args, consumer_args) -> tuple[object, float]:
    """Run ``consumer`` then ``producer`` in their own processes; returns what the consumer
    reported and the producer's CPU seconds per group."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    c = ctx.Process(target=consumer, args=(*consumer_args, out))
    c.start()
    assert _get(out, [c], 60) == "ready"
    p = ctx.Process(target=producer, args=(*producer_args, out))
    p.start()
    results = [_get(out, [c, p], 300) for _ in range(2)]  # in either order
    producer_cpu = next(r[1] for r in results if isinstance(r, tuple) and r[0] == "producer_cpu")
    consumer_result = next(r for r in results if not (isinstance(r, tuple) and r[0] == "producer_cpu"))
    for proc in (p, c):
        proc.join(timeout=120)
        if proc.exitcode != 0:
            raise RuntimeError(f"{proc.name} exited with {proc.exitcode}")
    return consumer_result, producer_cpu


def _get(out, procs, timeout: float):
    """The next item from ``out``; fails at once (not after ``timeout``) if a process died."""
    import queue

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return out.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited with {dead[0].exitcode} (its traceback is above)")
    raise TimeoutError(f"no result within {timeout}s")


# ---------------------------------------------------------------------------------- (c) ray queue


def _ray_rate(tokens: int, count: int, warmup: int, window: int) -> float:
    import asyncio

    import ray
    from ray import cloudpickle

    @ray.remote(num_cpus=0)
    class MessageQueue:
        """Bounded FIFO of pickled samples, as verl's fully-async MessageQueue (minus dropping)."""

        def __init__(self, maxsize: int) -> None:
            self.queue: asyncio.Queue = asyncio.Queue(maxsize)

        async def put_sample(self, data: bytes) -> None:
            await self.queue.put(data)

        async def get_sample(self) -> bytes:
            return await self.queue.get()

    @ray.remote(num_cpus=0)
    class Producer:
        async def run(self, queue, tokens: int, count: int) -> None:
            arrays = _arrays(tokens, 1)
            groups = [make_group(i, arrays) for i in range(count)]
            for g in groups:
                await queue.put_sample.remote(cloudpickle.dumps(g))

    @ray.remote(num_cpus=0)
    class Consumer:
        async def run(self, queue, count: int) -> list[float]:
            times = []
            for _ in range(count):
                group = cloudpickle.loads(await queue.get_sample.remote())
                times.append(time.monotonic())
            assert len(group.trajectories) == N_RESPONSES
            return times

    queue = MessageQueue.remote(window)
    consumer, producer = Consumer.remote(), Producer.remote()
    times_ref = consumer.run.remote(queue, count)
    ray.get(producer.run.remote(queue, tokens, count))
    times = ray.get(times_ref)
    for actor in (queue, consumer, producer):
        ray.kill(actor)
    return _rate(times, warmup)


# ---------------------------------------------------------------------------------- main

# raw baselines run beside each pair of the first codec (see the module docstring)
EXTRA_RAW = ("raw_zmq_batched", "raw_zmq_untuned", "raw_zmq_gather")
CODECS = {"accel": "the C accelerator (asyncrl/queue/_fastgroups)", "python": "pure Python (ASYNCRL_PURE_PYTHON=1)"}


def _suffix(name: str, codec: str) -> str:
    """A case's JSON key suffix: none for 1k with the C codec, ``_8k`` and/or ``_py`` otherwise."""
    return ("" if name == "1k" else f"_{name}") + ("" if codec == "accel" else "_py")


def _use_codec(codec: str) -> None:
    """Make the processes spawned from now on run ``codec`` (they inherit the environment)."""
    if codec == "python":
        os.environ["ASYNCRL_PURE_PYTHON"] = "1"
    else:
        os.environ.pop("ASYNCRL_PURE_PYTHON", None)


def _stream_rate(tokens: int, count: int, args) -> tuple[float, float, bool, float, float]:
    """Groups/s of one stream run, the groups its messages held on average, whether C ran, and
    the CPU seconds per group of its producer and of its consumer."""
    port = free_port()
    (times, per_message, accelerated, consumer_cpu), producer_cpu = _run_pair(
        _stream_producer, _stream_consumer, (port, tokens, count, args.window), (port, count, args.window)
    )
    return _rate(times, args.warmup), per_message, accelerated, producer_cpu, consumer_cpu


def _spread(values: list[float]) -> dict[str, float]:
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _load() -> float:
    return os.getloadavg()[0]


def _run_case(name: str, tokens: int, count: int, codec: str, args, extras: bool) -> dict:
    """``args.repeats`` runs of stream then raw ZeroMQ, back to back; each run's ratio is its
    stream's rate over the raw rate measured right after it, so a noisy neighbour hits both."""
    _use_codec(codec)
    runs = []
    for i in range(args.repeats):
        load = _load()
        stream, per_message, accelerated, *stream_cpu = _stream_rate(tokens, count, args)
        if accelerated != (codec == "accel"):
            raise RuntimeError(f"the stream ran {'C' if accelerated else 'pure Python'}, not {CODECS[codec]}: "
                               "build the extension with `python setup.py build_ext --inplace`")
        raw, *raw_cpu = _raw_rate(tokens, count, args.warmup, 1)
        run = {"stream": stream, "raw_zmq": raw, "vs_raw": stream / raw, "groups_per_message": per_message,
               "load_1m": load}
        # CPU per group (every thread, user + system) of each side: what a busy machine makes scarce.
        for path, (producer_cpu, consumer_cpu) in (("stream", stream_cpu), ("raw_zmq", raw_cpu)):
            run[f"{path}_cpu_us_producer"], run[f"{path}_cpu_us_consumer"] = producer_cpu * 1e6, consumer_cpu * 1e6
        if extras:  # after the pair, so they do not stretch the gap between its two halves
            run["raw_zmq_batched"] = _raw_rate(tokens, count, args.warmup, max(1, round(per_message)))[0]
            run["raw_zmq_untuned"] = _raw_rate(tokens, count, args.warmup, 1, tuned=False)[0]
            run["raw_zmq_gather"] = _raw_rate(tokens, count, args.warmup, 1, gather=True)[0]
        runs.append(run)
        others = "".join(f", {k} {run[k]:.0f}" for k in EXTRA_RAW if k in run)
        print(f"{name} {codec:<6} run {i + 1}/{args.repeats}: stream {stream:.0f} groups/s, raw_zmq {raw:.0f}"
              f"{others}, vs_raw {stream / raw:.3f}, {per_message:.1f} groups/message, load {load:.2f}; "
              f"CPU us/group producer+consumer: stream {run['stream_cpu_us_producer']:.0f}+"
              f"{run['stream_cpu_us_consumer']:.0f}, raw_zmq {run['raw_zmq_cpu_us_producer']:.0f}+"
              f"{run['raw_zmq_cpu_us_consumer']:.0f}", flush=True)
    return {"runs": runs, **{k: _spread([r[k] for r in runs]) for k in runs[0]}}


def main() -> None:
    import datetime
    import statistics

    args = _parse()
    cases = {"1k": (1024, args.groups_1k), "8k": (8192, args.groups_8k)}
    cases = {k: v for k, v in cases.items() if k in args.cases.split(",")}
    codecs = [c for c in args.codecs.split(",") if c]
    if unknown := [c for c in codecs if c not in CODECS]:
        raise SystemExit(f"--codecs: unknown {unknown}; choose from {','.join(CODECS)}")
    loads = [os.getloadavg()]
    results: dict = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                     "cpus": os.cpu_count(), "repeats": args.repeats}
    print(f"{results['date']}, {results['cpus']} CPUs, load average {'/'.join(f'{x:.2f}' for x in loads[0])}; "
          f"{args.repeats} runs per case and codec, stream then raw_zmq", flush=True)
    summary: dict[tuple[str, str], dict] = {}
    for codec in codecs:
        for name, (tokens, count) in cases.items():
            summary[name, codec] = _run_case(name, tokens, count, codec, args, extras=codec == codecs[0])
    _use_codec(codecs[0])
    ray_rates: dict[str, float] = {}
    if not args.skip_ray:
        import ray

        from asyncrl.placement import start_local_ray

        start_local_ray(num_cpus=2, log_to_driver=False, logging_level="ERROR")
        try:
            for name, (tokens, count) in cases.items():
                n = max(args.warmup + 50, int(count * args.ray_fraction))
                ray_rates[name] = statistics.median(_ray_rate(tokens, n, args.warmup, args.window)
                                                    for _ in range(args.repeats))
        finally:
            ray.shutdown()
    loads.append(os.getloadavg())

    print(f"\n{'case':<5} {'codec':<7} {'path':<16} {'groups/s median (min-max)':>28} {'MB/s median':>12}")
    for (name, codec), s in summary.items():
        mb = group_nbytes(cases[name][0]) / 1e6
        suffix = _suffix(name, codec)
        for path in ("stream", "raw_zmq", *EXTRA_RAW):
            if path in s:
                m = s[path]
                print(f"{name:<5} {codec:<7} {path:<16} {m['median']:>12.0f} ({m['min']:.0f}-{m['max']:.0f}) "
                      f"{m['median'] * mb:>12.1f}")
                results[f"{path}_groups_s{suffix}"] = round(m["median"], 1)
                results[f"{path}_mb_s{suffix}"] = round(m["median"] * mb, 1)
        for stat in ("median", "min", "max"):
            results[f"vs_raw_{stat}{suffix}"] = round(s["vs_raw"][stat], 3)
        results[f"vs_raw_runs{suffix}"] = [round(r["vs_raw"], 3) for r in s["runs"]]
        for path in EXTRA_RAW:
            if path in s:
                ratios = [r["stream"] / r[path] for r in s["runs"]]
                results[f"vs_{path[4:]}_median{suffix}"] = round(statistics.median(ratios), 3)
        results[f"groups_per_message{suffix}"] = round(s["groups_per_message"]["median"], 1)
        for key in ("stream_cpu_us_producer", "stream_cpu_us_consumer", "raw_zmq_cpu_us_producer",
                    "raw_zmq_cpu_us_consumer"):
            results[f"{key}{suffix}"] = round(s[key]["median"], 1)
        if name in ray_rates and codec == codecs[0]:
            print(f"{name:<5} {'':<7} {'ray_queue':<16} {ray_rates[name]:>12.0f} {'':>11} {ray_rates[name] * mb:>12.1f}")
            results[f"ray_queue_groups_s{suffix}"] = round(ray_rates[name], 1)
            results[f"vs_ray{suffix}"] = round(s["stream"]["median"] / ray_rates[name], 2)
        results[f"group_mb{suffix}"] = round(mb, 3)
    print()
    for (name, codec), s in summary.items():
        v, each = s["vs_raw"], ", ".join(f"{r['vs_raw']:.3f}" for r in s["runs"])
        cpu = {k: s[k]["median"] for k in s if "_cpu_us_" in k}
        print(f"{name} {codec}: vs_raw median {v['median']:.3f} (min {v['min']:.3f}, max {v['max']:.3f}), "
              f"runs {each}  (target: median >= 0.9); CPU us/group, median, producer+consumer: stream "
              f"{cpu['stream_cpu_us_producer']:.0f}+{cpu['stream_cpu_us_consumer']:.0f}, raw_zmq "
              f"{cpu['raw_zmq_cpu_us_producer']:.0f}+{cpu['raw_zmq_cpu_us_consumer']:.0f}"
              + (f"; vs raw_zmq_gather median {gather:.3f}"
                 if (gather := results.get(f"vs_zmq_gather_median{_suffix(name, codec)}")) is not None else ""))
    results["load_avg_start"] = [round(x, 2) for x in loads[0]]
    results["load_avg_end"] = [round(x, 2) for x in loads[-1]]
    print(f"load average at the start {'/'.join(f'{x:.2f}' for x in loads[0])}, "
          f"at the end {'/'.join(f'{x:.2f}' for x in loads[-1])} (1/5/15 min, {results['cpus']} CPUs)")
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
