"""``bench_scale.py --agent``: many multi-turn conversations at once through one Rollouter.

The real `Rollouter` runs `asyncrl.agent.EnvLoop` over a simulated tool env (`SimToolEnv`) on
simulated replicas (`EngineActor(kind="sim")`, in this process): ``--agent-conversations``
conversations in flight at once (``n`` per prompt, ``max_concurrent`` prompts), each
``--agent-turns`` model turns, every turn but the last answered by a tool call whose latency is
drawn, seeded, from a log-normal with median ``--tool-median-s`` and p99 ``--tool-p99-s``. Every
turn is one engine request with its conversation's ``session_id``, so a replica prefills only
the turn's new tokens (`asyncrl.rollouter.engines.sim_sessions`); the conversation is rendered
with a real chat template (`asyncrl.models.tiny_chat`) and the tool runs through the `ToolRunner`
as an async tool (a task on the loop, under its timeout and concurrency bound).

The feed admits ``--agent-rounds`` times the concurrency in all; the run ends when every
admitted group was sent. Measured:

- ``loop_lag_p99_ms``: a timer task sleeps 10 ms again and again and records how late it wakes,
  in the window below (the Rollouter's loop, which here also runs the replicas' schedulers: an
  upper bound; ``loop_lag_ticks``: how many wake-ups it saw there, 0 when the window had none and
  the whole run's stand in); ``run_lag_max_ms`` over the whole run (the start's admission burst included);
- ``turn_req_s``, ``tool_calls_per_s``: engine requests and tool calls a second while the
  concurrency was full (from the first moment it was, until the feed admitted its last group);
- ``lost`` / ``duplicated``: admitted conversations (prompt, k) that ended in no sent group / in
  more than one; ``bad_turns``: trajectories without ``--agent-turns`` turns; ``failed`` groups.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import time

import numpy as np

from asyncrl import calls
from asyncrl.agent.base import Env, Step

TARGET_LOOP_LAG_P99_MS = 50.0
TARGET_TURN_REQ_S = 2000.0
LAG_TICK_S = 0.01


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--agent: many conversations at once")
    g.add_argument("--agent", action="store_true", help="run the agent-loop scale bench instead of the replica sizes")
    g.add_argument("--agent-conversations", type=int, default=1000, help="conversations in flight at once")
    g.add_argument("--agent-rounds", type=float, default=4.0, help="conversations admitted in all, in units of the above")
    g.add_argument("--agent-n", type=int, default=1,
                   help="conversations per prompt (1: each its own group, so every one in flight is live; with more, "
                        "a group holds its slot until its slowest conversation ends)")
    g.add_argument("--agent-turns", type=int, default=4, help="model turns per conversation (a tool call after each but the last)")
    g.add_argument("--agent-replicas", type=int, default=32, help="simulated replicas")
    g.add_argument("--agent-hosts", type=int, default=0,
                   help="Ray actor processes the replicas live in, called over --engine-calls (0: in this process, "
                        "sharing the Rollouter's loop)")
    g.add_argument("--tool-median-s", type=float, default=0.2, help="tool latency: the log-normal's median")
    g.add_argument("--tool-p99-s", type=float, default=2.0, help="tool latency: the log-normal's p99")
    g.add_argument("--agent-repeats", type=int, default=3,
                   help="runs, one after another; the JSON carries each run's figures and their median (the machine "
                        "swings more from run to run than one run can tell)")
    g.add_argument("--event-loop", choices=("ray", "uvloop", "asyncio"), default="ray",
                   help="the Rollouter's event loop: 'ray' the one a Ray actor gets (uvloop where it is installed, "
                        "unless RAY_USE_UVLOOP=0), or the one named")
    g.add_argument("--prefill-tokens-per-s", type=float, default=320000.0,
                   help="a simulated replica's prefill speed for one request (0: prefill takes no time)")


def event_loop(choice: str) -> str:
    """The event loop ``--event-loop`` names: ``"uvloop"`` or ``"asyncio"``. In a run the Rollouter
    is a Ray actor, and Ray's workers run asyncio on uvloop when it is installed (asyncrl depends
    on it) unless ``RAY_USE_UVLOOP`` is false, so ``"ray"`` measures the loop the Rollouter has."""
    if choice != "ray":
        return choice
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "asyncio" if os.environ.get("RAY_USE_UVLOOP", "1").lower() in ("0", "false", "no") else "uvloop"


def run_on(loop_name: str, coro):
    """``asyncio.run(coro)`` on the named event loop."""
    if loop_name == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


class ToolLatency:
    """Seeded log-normal latencies with a given median and p99 (``mu = ln median``, ``sigma`` from the p99)."""

    def __init__(self, median_s: float, p99_s: float, seed: int):
        if not 0 < median_s <= p99_s:
            raise ValueError(f"tool latency needs 0 < median ({median_s}) <= p99 ({p99_s})")
        self.mu, self.sigma = math.log(median_s), math.log(p99_s / median_s) / 2.3263478740408408  # z of 0.99
        self.rng = np.random.default_rng(seed)

    def draw(self) -> float:
        return float(self.rng.lognormal(self.mu, self.sigma))


class SimToolEnv(Env):
    """Built per episode by the bench: every turn before the ``turns``-th calls one simulated tool
    (an async tool through the shared `ToolRunner`: it sleeps its drawn latency); that turn ends it."""

    def __init__(self, runner, sleep_tool, turns: int, latency: ToolLatency, counts: dict):
        self.runner, self.sleep_tool, self.turns, self.latency, self.counts = runner, sleep_tool, turns, latency, counts
        self.tools = (sleep_tool.schema,)
        self.turn = 0

    async def reset(self, prompt):
        self.counts["live"] += 1
        return [{"role": "user", "content": prompt.text}]

    async def step(self, assistant_text: str) -> Step:
        self.turn += 1
        if self.turn >= self.turns:
            self.counts["live"] -= 1
            return Step(observation=[], done=True)
        output = await self.runner.call(self.sleep_tool, {"seconds": self.latency.draw()})
        self.counts["tool_calls"] += 1
        return Step(observation=[{"role": "tool", "name": "lookup", "content": output}], tool_calls=1)

async def _lookup(seconds: float) -> str:
    """Look something up (a simulated tool: it takes ``seconds``).

    Args:
        seconds: how long the lookup takes
    """
    await asyncio.sleep(seconds)
    return "42"


def _agent(args: argparse.Namespace, counts: dict):
    """The Rollouter's `Agent`: `EnvLoop` over `SimToolEnv`, one `ToolRunner` for every episode."""
    from asyncrl.agent import EnvLoop, EnvLoopConfig, ToolRunner, ToolRunnerConfig, tool
    from asyncrl.models.tiny_chat import build_chat_tokenizer
    from asyncrl.rollouter.agents import Agent

    # The runner's bound must let every conversation's tool run at once, or it, not the Rollouter, is the bound.
    runner = ToolRunner(ToolRunnerConfig(tool_timeout_s=60.0, tool_concurrency=args.agent_conversations))
    latency = ToolLatency(args.tool_median_s, args.tool_p99_s, args.seed)
    sleep_tool = tool(_lookup, name="lookup")
    loop = EnvLoop(lambda: SimToolEnv(runner, sleep_tool, args.agent_turns, latency, counts), build_chat_tokenizer(),
                   EnvLoopConfig(max_turns=args.agent_turns, max_tokens_per_turn=128, max_context_tokens=8192))
    return Agent(loop, "bench_scale --agent", runner=runner)


def _reward(prompt, response_ids) -> float:
    return float(len(response_ids) % 2)  # synchronous, as the built-in task's: on the reward threads


class _Sink:
    """The producer as the Rollouter sees it: keeps the sample ids, turns and statuses of what it is sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, list[tuple[int, int]]]] = []  # (sample_id, status, [(k, turns)])
        self.changed = asyncio.Event()

    async def send(self, group) -> None:
        self.sent.append((group.sample_id, group.status, [(t.index, t.turns) for t in group.trajectories]))
        self.changed.set()


class GcPauses:
    """Durations of the collector's runs (a pause of the event loop the lag timer also sees)."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self.oldest: list[float] = []
        """Those of full collections (generation 2)."""
        self.garbage = 0
        """Objects the collector freed: garbage in reference cycles, which refcounting leaves to it."""
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._t0)
            self.garbage += info["collected"]
            if info["generation"] == 2:
                self.oldest.append(self.pauses[-1])


async def _lag_timer(lags: list[float], live: list[int], counts: dict, stop: asyncio.Event) -> None:
    """How late a 10 ms sleep wakes, again and again: the event loop's lag (and the live conversations then).
    uvloop's timers count whole milliseconds from the time its loop last read, so a sleep may end a
    little before 10 ms have passed here: such a wake is no lag, 0."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(LAG_TICK_S)
        lags.append(max(0.0, time.perf_counter() - t0 - LAG_TICK_S))
        live.append(counts["live"])


def check_delivery(admitted: list[str], sent, n: int, turns: int) -> dict:
    """lost / duplicated conversations (sample_id, k), trajectories without ``turns`` turns, failed groups."""
    seen: dict[tuple[str, int], int] = {}
    bad_turns = failed = 0
    for sample_id, status, trajectories in sent:
        failed += status != "ok"
        for k, t in trajectories:
            seen[(sample_id, k)] = seen.get((sample_id, k), 0) + 1
            bad_turns += t != turns
    wanted = {(s, k) for s in admitted for k in range(n)}
    return {"lost": len(wanted - seen.keys()), "duplicated": sum(c - 1 for c in seen.values() if c > 1)
            + len(seen.keys() - wanted), "bad_turns": bad_turns, "failed": failed}


async def agent_run(args: argparse.Namespace, *, make_agent=None, ray_replicas=None) -> dict:
    """One run (see the module docstring): the figures as a dict. ``make_agent(args, counts)``: the
    Rollouter's `Agent` (default: the `EnvLoop` of `_agent`; ``bench_scale_http.http_agent`` for
    ``--http``); ``ray_replicas``: how ``--agent-hosts`` Ray actors host the replicas
    (``bench_scale._ray_replicas``, handed down by the script that imports this one)."""
    from asyncrl.rollouter.actor import EngineActor
    from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter, settle_gc

    n = args.agent_n
    if args.agent_conversations % n:
        raise SystemExit(f"--agent-conversations ({args.agent_conversations}) must be a multiple of --n ({n})")
    concurrent = args.agent_conversations // n
    total = max(concurrent, round(concurrent * args.agent_rounds))
    counts = {"tool_calls": 0, "live": 0}
    agent = (make_agent or _agent)(args, counts)
    client_cpu = getattr(agent, "client_cpu", None)  # the CPU so far of clients in a process of their own (--http)
    endpoint_stats = getattr(agent, "endpoint_stats", None)  # the endpoint's own process (--endpoint-server process)
    prefill = args.prefill_tokens_per_s or None
    hosts = []
    if args.agent_hosts:  # the replicas in Ray actor processes, as in a run (their schedulers leave this loop)
        from asyncrl.placement import start_local_ray

        if ray_replicas is None:
            raise SystemExit("--agent-hosts runs the replicas in Ray actors: run it as scripts/bench_scale.py --agent")
        start_local_ray(num_cpus=2, log_to_driver=False)
        engines, hosts = ray_replicas(args, args.agent_replicas, args.agent_hosts, prefill_tokens_per_s=prefill)
    else:
        engines = [EngineActor(kind="sim", max_running=args.max_running, tokens_per_s=args.tokens_per_s,
                               prefill_tokens_per_s=prefill, seed=args.seed * 1000 + r) for r in range(args.agent_replicas)]
    cfg = RolloutConfig(n=n, max_tokens=128, groups_per_sync=total, staleness_threshold=0.0, seed=args.seed,
                        max_concurrent=concurrent, request_timeout_s=600.0, result_batch_s=args.result_batch_s,
                        engine_calls=args.engine_calls)
    prompts = [Prompt(text=f"What is {i % 90 + 10} times {i % 7 + 3}?", prompt_ids=np.array([1], dtype=np.int64))
               for i in range(total)]
    sink = _Sink()
    admitted: list[str] = []

    fed = asyncio.Event()  # the feed admitted its last group: the window closes (the drain is left out)

    class Counted(Rollouter):
        def _draw(self):
            sample_id, prompt = super()._draw()
            admitted.append(sample_id)
            if len(admitted) == total:
                fed.set()
            return sample_id, prompt

    rollouter = Counted(cfg, engines, sink, prompts, _reward, agent=agent)

    async def stats() -> list[dict]:
        return list(await asyncio.gather(*(calls.call(e, "stats") for e in engines)))

    async def requests() -> int:
        return sum(s["requests"] for s in await stats())

    lags: list[float] = []
    live: list[int] = []
    stop = asyncio.Event()
    settle_gc()
    gc_pauses = GcPauses()
    gc.callbacks.append(gc_pauses)
    timer = asyncio.create_task(_lag_timer(lags, live, counts, stop))
    t_start, c_start = time.perf_counter(), time.process_time()
    run = asyncio.create_task(rollouter.run(num_groups=total))
    try:
        while len(admitted) < concurrent and not run.done():  # the window opens once the concurrency is full
            await asyncio.sleep(0.005)
        t0, r0, k0, lag0, cpu0 = time.perf_counter(), await requests(), counts["tool_calls"], len(lags), time.process_time()
        x0 = await client_cpu() if client_cpu else 0.0
        e0 = (await endpoint_stats())["cpu_s"] if endpoint_stats else 0.0  # (its lag ticks so far dropped)
        fed_wait = asyncio.create_task(fed.wait())
        await asyncio.wait({run, fed_wait}, return_when=asyncio.FIRST_COMPLETED)  # a failed run ends the wait too
        fed_wait.cancel()
        t1, r1, k1, lag1, cpu1 = time.perf_counter(), await requests(), counts["tool_calls"], len(lags), time.process_time()
        x1 = await client_cpu() if client_cpu else 0.0
        e1 = await endpoint_stats() if endpoint_stats else {"cpu_s": 0.0, "lags_ms": [], "gc_pauses_ms": []}
        deadline = time.monotonic() + 600
        while len(sink.sent) < len(admitted) and time.monotonic() < deadline:
            sink.changed.clear()
            with_timeout = max(0.0, deadline - time.monotonic())
            try:
                await asyncio.wait_for(sink.changed.wait(), with_timeout)
            except TimeoutError:
                break
        await run  # returns once every admitted group ended
        gc.collect()  # what the run left in reference cycles (counted in gc_garbage)
        wall, cpu = time.perf_counter() - t_start, time.process_time() - c_start
        replica_stats = await stats()
    finally:
        stop.set()
        await rollouter.stop()
        await asyncio.gather(timer, run, return_exceptions=True)
        if hosts:
            import ray

            for host in hosts:
                ray.kill(host)
            ray.shutdown()
        else:
            for e in engines:
                await e.close()
        await agent.aclose()
        gc.callbacks.remove(gc_pauses)
    window = max(t1 - t0, 1e-9)
    turn_requests = sum(s["requests"] for s in replica_stats)
    turns = [t for _, _, trajectories in sink.sent for _, t in trajectories]
    window_lags = lags[lag0:lag1] or lags  # the concurrency full; ``lags``: the whole run (start and drain included)
    return {
        "agent_conversations": args.agent_conversations, "conversations_admitted": len(admitted) * n,
        "conversations_sent": len(turns), "loop_lag_p50_ms": 1e3 * float(np.percentile(window_lags, 50)),
        "loop_lag_p99_ms": 1e3 * float(np.percentile(window_lags, 99)), "loop_lag_max_ms": 1e3 * max(window_lags),
        "run_lag_max_ms": 1e3 * max(lags), "loop_lag_ticks": lag1 - lag0, "live_conversations_mean": float(np.mean(live[lag0:lag1] or [0])),
        "turn_req_s": (r1 - r0) / window, "cpu_ms_per_turn": 1e3 * (cpu1 - cpu0) / max(r1 - r0, 1),
        "client_cpu_ms_per_turn": 1e3 * (x1 - x0) / max(r1 - r0, 1),
        "endpoint_cpu_ms_per_turn": 1e3 * (e1["cpu_s"] - e0) / max(r1 - r0, 1),
        "endpoint_lag_p99_ms": float(np.percentile(e1["lags_ms"], 99)) if e1["lags_ms"] else None,
        "endpoint_lag_max_ms": max(e1["lags_ms"], default=None),
        "endpoint_gc_pause_max_ms": max(e1["gc_pauses_ms"], default=None), "tool_calls_per_s": (k1 - k0) / window, "window_s": window,
        "mean_turns": float(np.mean(turns)) if turns else 0.0,
        **check_delivery(admitted, sink.sent, n, args.agent_turns),
        "turn_requests": turn_requests, "engine_calls_per_turn": rollouter.pool.calls / max(turn_requests, 1),
        "prefill_tokens_per_turn": sum(s["prefill_tokens"] for s in replica_stats) / max(turn_requests, 1),
        "session_tokens_reused_per_turn": sum(s["session_tokens_reused"] for s in replica_stats) / max(turn_requests, 1),
        "gc_pauses": len(gc_pauses.pauses), "gc_pause_max_ms": 1e3 * max(gc_pauses.pauses, default=0.0),
        "gc_pause_total_ms": 1e3 * sum(gc_pauses.pauses), "gc_garbage": gc_pauses.garbage, "gc_full": len(gc_pauses.oldest),
        "gc_full_max_ms": 1e3 * max(gc_pauses.oldest, default=0.0), "cpu_util": cpu / wall, "wall_s": wall, "replicas": args.agent_replicas, "hosts": args.agent_hosts, "load_avg_1m": os.getloadavg()[0],
    }


SUMMED = ("lost", "duplicated", "bad_turns", "failed", "gc_garbage")
"""Counts over every run; the other figures are the runs' medians (see `combine`)."""
PER_RUN = ("loop_lag_p50_ms", "loop_lag_p99_ms", "loop_lag_max_ms", "run_lag_max_ms", "loop_lag_ticks", "turn_req_s", "cpu_ms_per_turn", "gc_pause_max_ms", "load_avg_1m")


def combine(results: list[dict]) -> dict:
    """One JSON for several runs: each figure the median of the runs (counts of what went wrong
    summed over them), ``runs`` the main figures of each, and the worst run's lag and rate."""
    out = {}
    for key, value in results[0].items():
        values = [r[key] for r in results]
        if key in SUMMED:
            out[key] = sum(values)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(np.median(values)) if len(values) > 1 else value
        else:
            out[key] = value
    out["repeats"] = len(results)
    out["loop_lag_p99_ms_max"] = max(r["loop_lag_p99_ms"] for r in results)
    out["turn_req_s_min"] = min(r["turn_req_s"] for r in results)
    out["runs"] = [{k: r[k] for k in PER_RUN} for r in results]
    return out


def report(result: dict) -> str:
    r = result
    return (f"agent: {r['agent_conversations']} conversations at once ({r['conversations_admitted']} admitted, "
            f"{r['conversations_sent']} sent, {r['live_conversations_mean']:.0f} live on average, {r['wall_s']:.1f} s, CPU {r['cpu_util']:.2f}): loop lag p50 "
            f"{r['loop_lag_p50_ms']:.1f} p99 {r['loop_lag_p99_ms']:.1f} max {r['loop_lag_max_ms']:.1f} ms (target p99 <= "
            f"{TARGET_LOOP_LAG_P99_MS:g}; over the whole run, start and drain included, max "
            f"{r['run_lag_max_ms']:.1f} ms; GC max {r['gc_pause_max_ms']:.1f} ms), {r['turn_req_s']:.0f} turn "
            f"requests/s (target >= {TARGET_TURN_REQ_S:g}; {r['cpu_ms_per_turn']:.2f} ms CPU each), "
            f"{r['tool_calls_per_s']:.0f} tool calls/s, mean turns {r['mean_turns']:.2f}, {r['engine_calls_per_turn']:.2f} "
            f"engine calls/turn, prefill {r['prefill_tokens_per_turn']:.1f} tokens/turn (reused "
            f"{r['session_tokens_reused_per_turn']:.1f}); lost {r['lost']} duplicated {r['duplicated']} bad turns "
            f"{r['bad_turns']} failed {r['failed']}; load average {r['load_avg_1m']:.2f}")
