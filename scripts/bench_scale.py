"""The control plane at cluster size: the Rollouter driven at 1, 8, 32 and 128 engine replicas.

On a cluster run the GPUs are not what breaks first; the single processes that coordinate them
are. This benchmark drives the real coordinating code with simulated engines
(`asyncrl.rollouter.engines.sim.SimEngine`: no model, tokens on a clock, the real pause / abort /
weight-version semantics) so that 128 replicas fit on a 2-core machine:

- one process per size plays the Rollouter's: the real `Rollouter` (staleness gate, reward
  threads, dispatch by group: a group's requests in one call to one replica), its
  `StreamProducer`, and a `WeightSyncCoordinator` that pauses every replica (``keep``), makes an
  empty update (``finish_weight_update`` of the next version, no tensors) and resumes them all,
  every ``--groups-per-sync`` groups the trainer acks;
- the replicas (``EngineActor(kind="sim")``, each with its own scheduler task: ``--max-running``
  slots, ``--tokens-per-s`` with every slot busy, the long-tail lengths of ``bench_e2e.py``:
  median 6 tokens, up to 96) live in ``--hosts`` Ray actor processes (``SimHost``, several
  replicas each), so every group call, pause, update and resume crosses Ray as in a real run
  (``ray_hop``); the Rollouter's CPU per request is then its own and Ray's caller side. With
  ``--in-process`` as well (the default runs both), the same run with the replicas inside the
  Rollouter's process, no Ray: the figures before the Ray hop was counted, for comparison;
- a second process plays the trainer: a `StreamConsumer` that takes ``--groups-per-sync``
  groups, "trains" for ``groups / --train-groups-s`` seconds, acks them, and goes on.

Async mode (``staleness_threshold`` 1), groups of ``--n`` responses, ``max_concurrent`` enough
prompts to fill every slot. After ``--warmup-s`` the clock runs ``--seconds``. Reported per size:

- ``req_s``: responses completed (in groups sent) per second; ``cpu_ms_per_req``: CPU seconds of
  the Rollouter's process (every thread) per response;
- ``sync_fanout_p50_ms`` / ``p99``: pause-all -> (empty) update -> resume-all over every replica;
- ``gate_lag_p99_ms``: after a sync opens the gate, until the Rollouter has admitted every group
  the new budget allows;
- ``agg_lag_p99_ms``: a separate ``--agg-seconds`` run of ``--mode sync --partial-rollout true``
  (the AggregatorActor's rounds): from the group report that reaches a round's count until
  every replica has been told to truncate; ``agg_report_p50_ms`` of every report;
- ``rss_mb``: the Rollouter process's resident memory at the end.

    python scripts/bench_scale.py --json

``--agent`` runs another bench instead: 1,000 multi-turn tool-using conversations at once through
one Rollouter (`bench_scale_agent`: the event loop's lag, turn requests/s, nothing lost or duplicated).

    python scripts/bench_scale.py --agent --json
    python scripts/bench_scale.py --agent --http --json    # the same over real HTTP (bench_scale_http)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import time

import numpy as np

import bench_scale_agent
import bench_scale_http
from asyncrl.rpc import Serving

os.environ.setdefault("OMP_NUM_THREADS", "1")

TARGET_REQ_S = 2000.0
TARGET_FANOUT_P99_MS = 100.0
TARGET_CPU_RATIO = 1.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 8, 32, 128], help="engine replicas, one run each")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--groups-per-sync", type=int, default=0,
                   help="groups per train step and weight sync (0: 2 per replica, at least 8)")
    p.add_argument("--max-running", type=int, default=32, help="slots per replica")
    p.add_argument("--tokens-per-s", type=float, default=32000.0, help="tokens a second of one replica with every slot busy")
    p.add_argument("--train-groups-s", type=float, default=2000.0, help="groups a second the trainer consumes")
    p.add_argument("--paced-req-s", type=float, default=2000.0,
                   help="the paced run: responses a second the trainer takes (latencies are measured there)")
    p.add_argument("--probe-s", type=float, default=0.1,
                   help="the paced run: an extra pause-all -> update -> resume-all every this many seconds")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=8.0, help="measured time per size")
    p.add_argument("--paced-seconds", type=float, default=30.0,
                   help="measured time of the paced run (its syncs give the fan-out's p99: ~7 a second)")
    p.add_argument("--agg-seconds", type=float, default=4.0, help="the aggregator's run per size (0: leave it out)")
    p.add_argument("--ray-calls", type=int, default=0, help="also time this many Ray actor calls (0: leave out)")
    p.add_argument("--result-batch-s", type=lambda v: None if v == "none" else float(v), default=0.02,
                   help="RolloutConfig.result_batch_s: a group call's results streamed in batches this far apart "
                        "('none': one plain call per group, answered at its end)")
    p.add_argument("--hosts", type=int, default=4, help="Ray actor processes the replicas are spread over")
    p.add_argument("--host-niceness", type=int, default=0,
                   help="niceness the host processes add to their own (0: the Rollouter's priority, as Ray actors "
                        "of one run have; 15: Ray's default for its workers, behind the Rollouter)")
    p.add_argument("--engine-calls", choices=("zmq", "ray"), default="zmq",
                   help="rollout.engine_calls: the Rollouter's and the coordinator's calls to the replicas' "
                        "actors over ZeroMQ (asyncrl.rpc; the default) or as Ray actor calls")
    p.add_argument("--modes", nargs="+", choices=("ray", "ray-calls", "in-process"),
                   default=["ray", "ray-calls", "in-process"],
                   help="where the replicas live: Ray actors called as --engine-calls says (the headline figures), "
                        "Ray actors called as Ray actor calls (the baseline before asyncrl.rpc), and/or the "
                        "Rollouter's process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    bench_scale_agent.add_args(p)
    bench_scale_http.add_args(p)
    args = p.parse_args(argv)
    if not 0 <= args.host_niceness <= 19:
        p.error(f"--host-niceness must be 0-19 (a process can only lower its own priority), got {args.host_niceness}")
    return args


# ---------------------------------------------------------------------------- the trainer's side


def _trainer(endpoint: str, groups_per_step: int, train_groups_s: float, ready, stop) -> None:
    """Take a step's groups, 'train' on them for a set time, ack them; until ``stop`` is set."""
    from asyncrl.queue import StreamConfig, StreamConsumer

    async def run() -> None:
        async with StreamConsumer(StreamConfig(endpoint=endpoint, window=4 * groups_per_step)) as consumer:
            ready.set()
            while not stop.is_set():
                step = []
                while len(step) < groups_per_step and not stop.is_set():
                    try:
                        step.append(await consumer.recv(timeout=0.5))
                    except TimeoutError:
                        pass
                await asyncio.sleep(len(step) / train_groups_s)
                consumer.ack([g.sample_id for g in step])

    asyncio.run(run())


# ---------------------------------------------------------------------------- the Rollouter's side


class _Remote:
    """``handle.method.remote(*args)`` on an in-process object, as the coordinator calls Ray actors."""

    def __init__(self, target) -> None:
        self._target = target

    def __getattr__(self, name: str):
        fn = getattr(self._target, name)

        class _Method:
            @staticmethod
            def remote(*args, **kwargs):
                return fn(*args, **kwargs)

        return _Method


class _EmptyUpdate:
    """An engine's side of an empty weight update: joining is a no-op, receiving makes the next
    version live with no tensors; pause, resume and version are the `EngineActor`'s."""

    def __init__(self, actor) -> None:
        self.actor = actor

    async def init_weight_sync(self, init) -> None:
        return None

    async def receive_weights(self, version: int, **_) -> None:
        await self.actor.finish_weight_update(version)

    def __getattr__(self, name: str):
        return getattr(self.actor, name)


class _EmptyTrainer:
    """Trainer rank 0 of an empty update: one `ReceiverInit` per engine, nothing sent."""

    async def init_weight_sync(self, init):
        from asyncrl.sync.base import ReceiverInit

        return [ReceiverInit(method=init.method) for _ in range(init.group.world_size - 1)]

    async def weight_update_kwargs(self, version: int) -> dict:
        return {}

    async def send_weights(self, version: int) -> None:
        return None


class SyncDriver:
    """The weight-sync coordinator in a Ray actor process of its own, as in a run (where it lives in
    the trainer's process, not the Rollouter's): it calls the replicas over the same path the
    Rollouter does (``engine_calls``)."""

    def __init__(self, handles: list, engine_calls: str) -> None:
        from asyncrl.sync.coordinator import WeightSyncConfig, WeightSyncCoordinator

        self.coordinator = WeightSyncCoordinator([_Remote(_EmptyTrainer())],
                                                 {f"engine[{i}]": h for i, h in enumerate(handles)},
                                                 WeightSyncConfig(retries=0), rpc=engine_calls == "zmq")

    def ready(self) -> bool:
        return True

    async def sync(self, republish: bool = False) -> tuple[int, float, float, float, float]:
        """One sync (``republish``: the current version again): (version, total, pause, update, resume seconds)."""
        c = self.coordinator
        version = await (c.republish() if republish else c.sync())
        return version, c.last.total_s, c.last.pause_s, c.last.transfer_s, c.last.resume_s


class SimHost(Serving):
    """Several simulated replicas in one Ray actor process, each an `EngineActor(kind="sim")` with
    an empty weight update; `_Hosted` calls one of them through Ray as if it were an actor of its
    own, and `asyncrl.rpc.RpcActor(host, endpoint, key=i)` over ZeroMQ (``serve_rpc``)."""

    def __init__(self, count: int, first_seed: int, niceness: int = 0, **sim) -> None:
        from asyncrl.rollouter.actor import EngineActor

        if niceness:  # (0-19, checked by parse_args: an unprivileged process cannot raise its priority)
            os.nice(niceness)
        self.replicas = [_EmptyUpdate(EngineActor(kind="sim", seed=first_seed + i, **sim)) for i in range(count)]

    def _rpc_resolve(self, i: int):
        return self.replicas[i]

    def ready(self) -> int:
        return len(self.replicas)

    async def generate_group(self, i: int, requests, truncatable: bool = False, batch_s: float = 0.0):
        async for batch in self.replicas[i].generate_group(requests, truncatable, batch_s):
            yield batch

    async def call(self, i: int, method: str, *args, **kwargs):
        from asyncrl.calls import call

        return await call(self.replicas[i], method, *args, **kwargs)


class _Hosted:
    """Replica ``i`` of a `SimHost` actor, with the methods of an actor handle of its own
    (``handle.method.remote(...)``, ``handle.generate_group.options(...).remote(...)``)."""

    def __init__(self, host, i: int) -> None:
        self.host, self.i = host, i

    def __reduce__(self):  # (handed to the coordinator's process)
        return _Hosted, (self.host, self.i)

    def __getattr__(self, name: str):
        if name == "generate_group":
            return _Bound(self.host.generate_group, (self.i,))
        return _Bound(self.host.call, (self.i, name))


class _Bound:
    """A host's actor method with the replica (and method name) bound in front of the arguments."""

    def __init__(self, method, head: tuple) -> None:
        self.method, self.head = method, head

    def options(self, **options):
        return _Bound(self.method.options(**options), self.head)

    def remote(self, *args, **kwargs):
        return self.method.remote(*self.head, *args, **kwargs)


def _ray_replicas(args: argparse.Namespace, replicas: int, hosts_n: int | None = None, **sim) -> tuple[list, list]:
    """``replicas`` simulated replicas over ``hosts_n`` (``--hosts``) Ray actors: (replica handles, host actors)."""
    import sys

    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # scripts/ is not importable in Ray's workers
    host_cls = ray.remote(num_cpus=0)(SimHost)
    hosts_n = min(hosts_n or args.hosts, replicas)
    counts = [replicas // hosts_n + (h < replicas % hosts_n) for h in range(hosts_n)]
    hosts, handles = [], []
    for h, count in enumerate(counts):
        host = host_cls.remote(count, args.seed * 1000 + len(handles), args.host_niceness,
                               max_running=args.max_running, tokens_per_s=args.tokens_per_s, **sim)
        hosts.append(host)
        handles += [_Hosted(host, i) for i in range(count)]
    ray.get([host.ready.remote() for host in hosts], timeout=120)
    if args.engine_calls == "zmq":  # as `asyncrl.rpc.link` makes them for an EngineActor of this node
        from asyncrl.rpc import Links, RpcActor

        served = ray.get([host.serve_rpc.remote() for host in hosts], timeout=120)
        links = Links()  # a host's replicas share its socket (a caller that links them moves them onto its own)
        handles = [RpcActor(hosts[h], served[h]["endpoint"], key=i, links=links)  # (signed with the run's key)
                   for h, count in enumerate(counts) for i in range(count)]
    return handles, hosts


class _Counted:
    """The producer as the Rollouter sees it, counting the groups it is given."""

    def __init__(self, producer) -> None:
        self.producer = producer
        self.groups = 0

    async def send(self, group) -> None:
        await self.producer.send(group)
        self.groups += 1

    @property
    def unacked(self):
        return self.producer.unacked


def _prompts(count: int = 4096) -> list:
    from asyncrl.rollouter.rollouter import Prompt

    return [Prompt(text=f"{i % 90 + 10}+{i % 7}=", prompt_ids=np.array([1, 4 + i % 50, 5, 6], dtype=np.int64))
            for i in range(count)]


def _reward(prompt, response_ids) -> float:
    return float(len(response_ids) % 2)  # a synchronous reward, as the built-in task's: on the reward threads


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


async def _async_run(args: argparse.Namespace, replicas: int, endpoint: str, probe_s: float | None,
                     ray_hop: bool, seconds: float) -> dict:
    """One async-mode run; with ``probe_s`` the bench also times an extra pause-all -> update ->
    resume-all (`WeightSyncCoordinator.republish`: the current version again) every ``probe_s``.
    ``ray_hop``: the replicas live in Ray actors (`_ray_replicas`), else in this process."""
    import psutil

    from asyncrl.queue import StreamConfig, StreamProducer
    from asyncrl.rollouter.actor import EngineActor
    from asyncrl.rollouter.rollouter import RolloutConfig, Rollouter, settle_gc

    g = _groups_per_sync(args, replicas)
    if ray_hop:
        engines, hosts = _ray_replicas(args, replicas)
        handles = engines
    else:
        engines = [EngineActor(kind="sim", max_running=args.max_running, tokens_per_s=args.tokens_per_s,
                               seed=args.seed * 1000 + r) for r in range(replicas)]
        handles = [_Remote(_EmptyUpdate(e)) for e in engines]  # as the coordinator reaches Ray actors
    cfg = RolloutConfig(n=args.n, max_tokens=96, groups_per_sync=g, staleness_threshold=1.0, seed=args.seed,
                        result_batch_s=args.result_batch_s, engine_calls=args.engine_calls,
                        max_concurrent=max(g, replicas * args.max_running // args.n), request_timeout_s=600.0)
    admissions: list[float] = []
    syncs: list[tuple[float, int]] = []  # (time the sync opened the gate, admissions it allows)

    class Timed(Rollouter):
        def _draw(self):
            admissions.append(time.perf_counter())
            return super()._draw()

        async def on_sync(self, version: int) -> None:
            t0 = time.perf_counter()
            await super().on_sync(version)
            budget = (self.version + 1 + self.cfg.staleness_threshold) * self.cfg.groups_per_sync
            allowed = min(budget - (self.admitted - len(self.given_back) - self.state.dropped),
                          self.cfg.max_concurrent - (self.admitted - self.sent))
            if allowed >= 1:
                syncs.append((t0, len(admissions) + int(allowed)))

    producer = StreamProducer(StreamConfig(endpoint=endpoint, window=4 * g), producer_id="bench-scale")
    await producer.start()
    counted = _Counted(producer)
    rollouter = Timed(cfg, engines, counted, _prompts(), _reward)
    if ray_hop:  # the coordinator in a process of its own, as in a run
        import ray

        driver = ray.remote(num_cpus=0)(SyncDriver).remote(handles, args.engine_calls)
        await driver.ready.remote()  # its process is up before the clock starts

        async def sync(republish: bool = False) -> tuple[int, float, float, float, float]:
            return await driver.sync.remote(republish)
    else:  # in this process, on the Rollouter's loop
        sync = SyncDriver(handles, args.engine_calls).sync
    fanout: list[float] = []
    phases: list[tuple[float, float, float]] = []  # (pause, update, resume) of each sync
    measuring = False
    stop = asyncio.Event()

    async def trainer_loop() -> None:
        # The trainer's sync: after each step's groups are acked, pause-all -> update -> resume-all.
        version = 0
        while not stop.is_set():
            while producer.stats.acked < (version + 1) * g and not stop.is_set():
                await asyncio.sleep(0.001)
            if stop.is_set():
                return
            await rollouter.on_pause()
            version, total, *phase = await sync()
            if measuring:
                fanout.append(total)
                phases.append(tuple(phase))
            await rollouter.on_sync(version)

    async def probe_loop() -> None:
        while probe_s and not stop.is_set():
            await asyncio.sleep(probe_s)
            await rollouter.on_pause()
            version, total, *phase = await sync(republish=True)
            if measuring:
                fanout.append(total)
                phases.append(tuple(phase))
            await rollouter.on_sync(version)

    settle_gc()  # as the Rollouter's process does once set up
    task = asyncio.create_task(rollouter.run())
    syncer = asyncio.create_task(trainer_loop())
    prober = asyncio.create_task(probe_loop())
    proc = psutil.Process()
    try:
        await asyncio.sleep(args.warmup_s)
        measuring = True
        t0, c0, n0, s0 = time.perf_counter(), time.process_time(), counted.groups, len(syncs)
        await asyncio.sleep(seconds)
        t1, c1, n1 = time.perf_counter(), time.process_time(), counted.groups
        # calls per group over the whole run, warm-up included: a structural ratio, not a rate (on a
        # loaded machine a short window can hold groups admitted before it and no admission)
        calls, admitted = rollouter.pool.calls, rollouter.admitted
        measuring = False
        gate = [admissions[k - 1] - t for t, k in syncs[s0:] if k <= len(admissions)]
        rss = proc.memory_info().rss
        for t in (task, syncer, prober):
            if t.done():
                await t  # a failure inside either is the run's error
    finally:
        stop.set()
        await rollouter.stop()
        await asyncio.gather(task, syncer, prober, return_exceptions=True)
        if ray_hop:
            import ray

            for actor in (*hosts, driver):
                ray.kill(actor)
        else:
            for e in engines:
                await e.close()
        await producer.close()
    requests = (n1 - n0) * args.n
    return {"ray_hop": ray_hop, "engine_calls": args.engine_calls if ray_hop else "in-process",
            "engine_calls_per_group": calls / max(admitted, 1),
            "req_s": requests / (t1 - t0), "cpu_ms_per_req": 1e3 * (c1 - c0) / max(requests, 1),
            "cpu_util": (c1 - c0) / (t1 - t0), "syncs": len(fanout),
            "sync_fanout_p50_ms": 1e3 * _pct(fanout, 50), "sync_fanout_p99_ms": 1e3 * _pct(fanout, 99),
            "sync_fanout_max_ms": 1e3 * max(fanout, default=float("nan")),
            "gate_lag_p50_ms": 1e3 * _pct(gate, 50), "gate_lag_p99_ms": 1e3 * _pct(gate, 99),
            "rss_mb": rss / 2**20, "groups_per_sync": g,
            "sync_phases_p50_ms": [round(1e3 * _pct([p[i] for p in phases], 50), 2) for i in range(3)],
            "sync_phases_p99_ms": [round(1e3 * _pct([p[i] for p in phases], 99), 2) for i in range(3)]}


async def _aggregator_run(args: argparse.Namespace, replicas: int) -> dict:
    """``--mode sync --partial-rollout true`` for ``--agg-seconds``: the AggregatorActor's rounds."""
    from asyncrl.queue.memory import MemorySink
    from asyncrl.rollouter.actor import EngineActor
    from asyncrl.rollouter.aggregator import AggregatorActor
    from asyncrl.rollouter.partial import PartialRolloutConfig
    from asyncrl.rollouter.rollouter import RolloutConfig, Rollouter

    g = _groups_per_sync(args, replicas)
    reports: list[float] = []
    ended_at: dict[int, float] = {}  # round -> when the report that reached its count began
    signalled_at: dict[int, float] = {}  # round -> when the last replica had stopped its requests

    class Signalled(EngineActor):
        async def truncate(self, version: int, queued: bool = False) -> int:
            stopped = await super().truncate(version, queued)
            signalled_at[version] = time.perf_counter()
            return stopped

    class Timed(AggregatorActor):
        async def report(self, version, per_replica):
            t0 = time.perf_counter()
            ended = await super().report(version, per_replica)
            if ended:
                ended_at[version] = t0
            else:
                reports.append(time.perf_counter() - t0)
            return ended

    engines = [Signalled(kind="sim", max_running=args.max_running, tokens_per_s=args.tokens_per_s,
                         seed=args.seed * 1000 + r) for r in range(replicas)]

    sink = MemorySink()
    cfg = RolloutConfig(n=args.n, max_tokens=96, groups_per_sync=g, staleness_threshold=0.0, seed=args.seed,
                        max_concurrent=2 * g, request_timeout_s=600.0)
    rollouter = Rollouter(cfg, engines, sink, _prompts(), _reward,
                          partial=PartialRolloutConfig(enable=True, truncate_at="threshold", max_age=4),
                          aggregator=Timed(engines, None))
    task = asyncio.create_task(rollouter.run())
    deadline = time.perf_counter() + args.agg_seconds
    try:
        version = 0
        while time.perf_counter() < deadline:
            while len([x for x in sink.groups if x.complete]) < (version + 1) * g:
                if task.done():
                    await task
                await asyncio.sleep(0.001)
            await rollouter.on_pause()
            version += 1
            for e in engines:
                await e.pause("keep")
                await e.finish_weight_update(version)
                await e.resume()
            await rollouter.on_sync(version)
    finally:
        await rollouter.stop()
        await asyncio.gather(task, return_exceptions=True)
        for e in engines:
            await e.close()
    lags = [signalled_at[v] - t for v, t in ended_at.items() if v in signalled_at]
    return {"rounds": len(lags), "agg_lag_p50_ms": 1e3 * _pct(lags, 50), "agg_lag_p99_ms": 1e3 * _pct(lags, 99),
            "agg_report_p50_ms": 1e3 * _pct(reports, 50)}


def _groups_per_sync(args: argparse.Namespace, replicas: int) -> int:
    return args.groups_per_sync or max(8, 2 * replicas)


def _with_trainer(args: argparse.Namespace, replicas: int, groups_s: float, probe_s: float | None,
                  ray_hop: bool, seconds: float) -> dict:
    """`_async_run` against a trainer process that consumes ``groups_s`` groups a second."""
    from asyncrl.net import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    trainer = ctx.Process(target=_trainer, args=(endpoint, _groups_per_sync(args, replicas), groups_s, ready, stop),
                          daemon=True)
    trainer.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the trainer's consumer did not start within 60 s")
        return asyncio.run(_async_run(args, replicas, endpoint, probe_s, ray_hop, seconds))
    finally:
        stop.set()
        trainer.join(10)
        if trainer.is_alive():
            trainer.kill()


def _one_size(args: argparse.Namespace, replicas: int, ray_hop: bool, agg: bool, out) -> None:
    """One size, in a process of its own (so its CPU time and memory are its own); with
    ``ray_hop`` the process starts a local Ray for its replicas' actors."""
    if ray_hop:
        from asyncrl.placement import start_local_ray

        start_local_ray(num_cpus=2, log_to_driver=False)
    # Saturated: the trainer takes groups as fast as they come, so the Rollouter is the bound.
    result = _with_trainer(args, replicas, args.train_groups_s, None, ray_hop, args.seconds)
    # Paced at --paced-req-s: the latencies of a Rollouter at work but not saturated. Long enough for
    # a p99 (~200 syncs at the defaults): over 8 s's ~50 syncs np.percentile's p99 was the maximum.
    paced = _with_trainer(args, replicas, args.paced_req_s / args.n, args.probe_s, ray_hop, args.paced_seconds)
    result.update({f"{k}": paced[k] for k in ("sync_fanout_p50_ms", "sync_fanout_p99_ms", "gate_lag_p50_ms",
                                              "gate_lag_p99_ms", "sync_phases_p50_ms", "sync_phases_p99_ms",
                                              "syncs", "sync_fanout_max_ms")},
                  paced_req_s=paced["req_s"], paced_cpu_util=paced["cpu_util"],
                  saturated_fanout_p99_ms=result["sync_fanout_p99_ms"], saturated_gate_lag_p99_ms=result["gate_lag_p99_ms"])
    if agg and args.agg_seconds > 0:  # the aggregator's rounds: once per size, replicas in process
        result.update(asyncio.run(_aggregator_run(args, replicas)))
    out.put(result)


def _ray_call_cost(calls: int) -> dict:
    """Ray's own cost of one actor call, from a driver to an async actor (what the figures leave out)."""
    import ray

    from asyncrl.placement import start_local_ray

    @ray.remote(num_cpus=0)
    class Echo:
        async def ping(self, x):
            return x

    start_local_ray(num_cpus=2, log_to_driver=False)
    try:
        actor = Echo.remote()
        ray.get(actor.ping.remote(0))

        async def burst():
            await asyncio.gather(*(actor.ping.remote(i) for i in range(calls)))

        t0, c0 = time.perf_counter(), time.process_time()
        asyncio.run(burst())
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        ray.shutdown()
    return {"ray_calls_s": calls / wall, "ray_driver_cpu_us_per_call": 1e6 * cpu / calls}


def _plan_64_nodes() -> tuple[float, str]:
    """The launcher's placement for 64 nodes x 8 GPUs, ``--rollouter-gpus 256 --trainer-gpus 256``,
    TP 4 (the planning function the dry run calls; 64 raylets do not fit here): seconds, and the plan."""
    t0 = time.perf_counter()
    from asyncrl.config import load_config
    from asyncrl.placement import Cluster, Node, make_plan

    cluster = Cluster(nodes=[Node(node_id=f"{i:04d}" + "ab" * 14, address=f"10.1.0.{i}", cpus=96, gpus=8, head=i == 0)
                             for i in range(64)], started_here=False)
    cfg, _ = load_config([], ["placement.rollouter_gpus=256", "placement.trainer_gpus=256",
                              "engine.tensor_parallel_size=4", "placement.nodes=64"])
    text = make_plan(cfg, cluster).describe()
    return time.perf_counter() - t0, text


KEYS = ["req_s", "cpu_ms_per_req", "sync_fanout_p50_ms", "sync_fanout_p99_ms", "sync_fanout_max_ms", "syncs",
        "gate_lag_p50_ms", "gate_lag_p99_ms", "agg_lag_p99_ms", "agg_report_p50_ms", "rss_mb", "groups_per_sync",
        "engine_calls_per_group"]


def _niceness(args: argparse.Namespace) -> str:
    return f", the hosts at niceness +{args.host_niceness}" if args.host_niceness else ""


SIZE_TIMEOUT_S = 900
"""One size's process (a local Ray, two runs against a trainer, the aggregator's rounds) past this is killed."""


def _sizes(args: argparse.Namespace, ray_hop: bool, agg: bool) -> list[dict]:
    """Every size of ``--replicas`` for one placement of the replicas, each in a process of its own."""
    ctx = mp.get_context("spawn")
    rows = []
    where = (f"in {args.hosts} Ray actor processes (fewer when fewer replicas), called over {args.engine_calls}"
             f"{_niceness(args)}" if ray_hop else "in process (no Ray)")
    print(f"replicas {where}:", flush=True)
    for replicas in args.replicas:
        out = ctx.Queue()
        proc = ctx.Process(target=_one_size, args=(args, replicas, ray_hop, agg, out))
        proc.start()
        proc.join(SIZE_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise SystemExit(f"bench_scale: the run at {replicas} replicas did not end within {SIZE_TIMEOUT_S} s")
        if proc.exitcode != 0 or out.empty():
            raise SystemExit(f"bench_scale: the run at {replicas} replicas failed (exit code {proc.exitcode})")
        r = out.get()
        rows.append({"replicas": replicas, **r})
        print(f"  {replicas:4d} replicas: {r['req_s']:7.0f} req/s  {r['cpu_ms_per_req']:.3f} ms CPU/req "
              f"(CPU {r['cpu_util']:.2f}, {r['engine_calls_per_group']:.2f} engine calls/group)  sync fan-out p50 "
              f"{r['sync_fanout_p50_ms']:.1f} p99 {r['sync_fanout_p99_ms']:.1f} max {r['sync_fanout_max_ms']:.1f} ms "
              f"({r['syncs']} syncs at "
              f"{r['paced_req_s']:.0f} req/s, CPU {r['paced_cpu_util']:.2f}; p50 pause/update/resume "
              f"{r['sync_phases_p50_ms']} ms, p99 {r['sync_phases_p99_ms']} ms)  gate lag p99 {r['gate_lag_p99_ms']:.1f} ms  aggregator lag p99 "
              f"{r.get('agg_lag_p99_ms', float('nan')):.1f} ms ({r.get('rounds', 0)} rounds)  RSS {r['rss_mb']:.0f} MB",
              flush=True)
    return rows


def _summary(rows: list[dict]) -> dict:
    out: dict = {"replicas": [r["replicas"] for r in rows]}
    for k in KEYS:
        out[k] = [round(r[k], 3) if k in r and r[k] == r[k] else None for r in rows]  # NaN -> null
    at8 = next((r for r in rows if r["replicas"] == 8), None)
    out["cpu_ratio_vs_8"] = round(rows[-1]["cpu_ms_per_req"] / at8["cpu_ms_per_req"], 3) if at8 else None
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.agent and args.http:
        return bench_scale_http.main(args, ray_replicas=_ray_replicas)
    if args.agent:
        return agent_main(args)
    load = os.getloadavg()
    print(f"bench_scale: replicas {args.replicas}, {args.max_running} slots x {args.tokens_per_s:g} tokens/s each, "
          f"n={args.n}, trainer {args.train_groups_s:g} groups/s, {args.seconds:g} s per size after "
          f"{args.warmup_s:g} s (the paced run {args.paced_seconds:g} s); load average {load[0]:.2f} {load[1]:.2f}",
          flush=True)
    modes = sorted(set(args.modes), key=["ray", "ray-calls", "in-process"].index)  # the Ray hop first: the headline
    as_ray_calls = argparse.Namespace(**{**vars(args), "engine_calls": "ray"})
    by_mode = {m: _sizes(as_ray_calls if m == "ray-calls" else args, m != "in-process", agg=m == modes[0])
               for m in modes}
    rows = by_mode[modes[0]]
    largest = rows[-1]
    result: dict = {"ray_hop": modes[0] != "in-process", **_summary(rows)}
    for m, key in (("ray-calls", "ray_calls"), ("in-process", "in_process")):  # the baselines, beside
        if m in modes and m != modes[0]:
            result[key] = {k: v for k, v in _summary(by_mode[m]).items() if k not in ("agg_lag_p99_ms", "agg_report_p50_ms")}
    if "ray_calls" in result:
        base = by_mode["ray-calls"][-1]
        result["req_s_vs_ray_calls"] = round(largest["req_s"] / base["req_s"], 2)
        print(f"at {largest['replicas']} replicas, {args.engine_calls} engine calls against Ray actor calls: "
              f"{result['req_s_vs_ray_calls']}x the requests/s, CPU per request "
              f"{largest['cpu_ms_per_req'] / base['cpu_ms_per_req']:.2f}x, fan-out p99 "
              f"{largest['sync_fanout_p99_ms']:.0f} against {base['sync_fanout_p99_ms']:.0f} ms", flush=True)
    plan_s, plan = _plan_64_nodes()
    result["plan_64_nodes_s"] = round(plan_s, 3)
    lines = plan.splitlines()
    print(f"the plan for 64 nodes x 8 GPUs (256 + 256 GPUs, TP 4): {len(lines)} lines in {plan_s:.2f} s (config "
          f"loading included); first and last:\n  {lines[0]}\n  {lines[1]}\n  ...\n  {lines[-1]}", flush=True)
    if args.ray_calls:
        result.update({k: round(v, 3) for k, v in _ray_call_cost(args.ray_calls).items()})
        print(f"  a bare Ray actor call, for reference: {result['ray_calls_s']:.0f} calls/s, "
              f"{result['ray_driver_cpu_us_per_call']:.0f} us of the caller's CPU each", flush=True)
    print(f"at {largest['replicas']} replicas{' through Ray' if result['ray_hop'] else ''}: {largest['req_s']:.0f} req/s (target >= {TARGET_REQ_S:g}), sync fan-out "
          f"p99 {largest['sync_fanout_p99_ms']:.1f} ms (target <= {TARGET_FANOUT_P99_MS:g}), CPU per request "
          f"{result['cpu_ratio_vs_8']}x of at 8 (target <= {TARGET_CPU_RATIO}); load average now "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    if args.json:
        print(json.dumps(result))
    return result


def agent_main(args: argparse.Namespace) -> dict:
    """``--agent``: many conversations at once (`bench_scale_agent`)."""
    if args.agent_repeats < 1:
        raise SystemExit(f"--agent-repeats must be >= 1, got {args.agent_repeats}")
    loop_name = bench_scale_agent.event_loop(args.event_loop)
    print(f"bench_scale --agent: {args.agent_conversations} conversations at once, {args.agent_turns} turns each, "
          f"n={args.agent_n}, {args.agent_replicas} simulated replicas "
          f"{f'in {args.agent_hosts} Ray actor processes, called over {args.engine_calls}{_niceness(args)}' if args.agent_hosts else 'in process'} ({args.max_running} slots x "
          f"{args.tokens_per_s:g} tokens/s), tool latency median {args.tool_median_s:g} s p99 {args.tool_p99_s:g} s, event "
          f"loop {loop_name}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    runs = []
    for i in range(args.agent_repeats):
        run = {**bench_scale_agent.run_on(loop_name, bench_scale_agent.agent_run(args, ray_replicas=_ray_replicas)), "event_loop": loop_name}
        runs.append({k: round(v, 3) if isinstance(v, float) else v for k, v in run.items()})
        print(f"run {i + 1}/{args.agent_repeats}: {bench_scale_agent.report(runs[-1])}", flush=True)
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in bench_scale_agent.combine(runs).items()}
    if len(runs) > 1:
        print(f"median of {len(runs)} runs: loop lag p99 {result['loop_lag_p99_ms']:.1f} ms (worst run "
              f"{result['loop_lag_p99_ms_max']:.1f}; target <= {bench_scale_agent.TARGET_LOOP_LAG_P99_MS:g}), "
              f"{result['turn_req_s']:.0f} turn requests/s (slowest run {result['turn_req_s_min']:.0f}; target >= "
              f"{bench_scale_agent.TARGET_TURN_REQ_S:g}), {result['cpu_ms_per_turn']:.2f} ms CPU per turn; lost "
              f"{result['lost']} duplicated {result['duplicated']} over every run; load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
