"""``bench_scale.py --agent --http``: the ``--agent`` bench with every episode an OpenAI-client agent
calling its endpoint over real HTTP (`asyncrl.agent.endpoint`), beside the in-process `EnvLoop` path.

Each episode is a function agent (an ``aiohttp`` client, one connection pool for all): it makes
``--agent-turns`` chat calls with a tool schema, echoing each answer back, with a simulated tool
call between two calls (the same seeded log-normal latency as ``--agent``). The endpoint serves it
on the Rollouter's event loop over the simulated replicas.

Where the clients run (``--http-clients``): ``process`` (the default) runs them in a process of
their own, as a real agent is the user's code or process: the function agent the Rollouter calls
hands the episode (row, base URL, key) to that process over a Unix socket and awaits its reward.
The loop lag and ``cpu_ms_per_call_server`` are then the endpoint's own (the Rollouter's process:
endpoint, Rollouter and simulated replicas), and ``cpu_ms_per_call`` is the server's and the client
process's CPU together. ``loop`` runs the clients on the Rollouter's own event loop, as before: lag
and CPU are then upper bounds that include the client side of HTTP.

First the in-process path runs (``cpu_ms_per_call_inprocess``: CPU per model turn of `EnvLoop`),
then the HTTP one; the JSON's last line has ``http``, ``episodes``, ``loop_lag_p99_ms``,
``calls_s``, ``cpu_ms_per_call``, ``cpu_ms_per_call_server``, ``cpu_ms_per_call_inprocess``,
``lost``, ``duplicated``, ``http_clients``.

    python scripts/bench_scale.py --agent --http --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import tempfile
import time


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http", action="store_true",
                   help="with --agent: every episode an OpenAI-client agent over real HTTP (bench_scale_http)")
    p.add_argument("--http-clients", choices=("process", "loop"), default="process",
                   help="with --http: the clients in a process of their own (an agent is the user's code), or on the "
                        "Rollouter's event loop (lag and CPU then include the client side: upper bounds)")
    p.add_argument("--endpoint-server", choices=("process", "loop"), default="process",
                   help="with --http: the endpoint in a process of its own next to the Rollouter, or on the Rollouter's "
                        "event loop (rollout.agent.endpoint_server)")


class HttpAgent:
    """The function agent of every episode (see the module docstring); `aclose` closes its connection pool."""

    def __init__(self, turns: int, latency, counts: dict):
        self.turns, self.latency, self.counts = turns, latency, counts
        self.session = None

    async def __call__(self, row: dict, client) -> float:
        await self.run(row, client)
        return 1.0

    async def run(self, row: dict, client) -> int:
        """One episode's calls; the tool calls it made."""
        import aiohttp
        import orjson  # (the clients are the load, not what is measured: they spend as little CPU as they can)

        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                 timeout=aiohttp.ClientTimeout(total=600))
        self.counts["live"] += 1
        headers = {"Authorization": f"Bearer {client.api_key}", "Content-Type": "application/json"}
        messages = [{"role": "user", "content": row["prompt"]}]
        tools = [{"type": "function", "function": {"name": "lookup", "description": "look up",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        made = 0
        try:
            for turn in range(self.turns):
                payload = orjson.dumps({"model": client.model, "messages": messages, "tools": tools})
                async with self.session.post(f"{client.base_url}/chat/completions", headers=headers, data=payload) as r:
                    body = orjson.loads(await r.read())
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {body}")
                if turn == self.turns - 1:
                    break
                await asyncio.sleep(self.latency.draw())  # the tool
                self.counts["tool_calls"] += 1
                made += 1
                messages += [body["choices"][0]["message"], {"role": "tool", "name": "lookup", "content": "42"}]
        finally:
            self.counts["live"] -= 1
        return made

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()


class ClientProcess:
    """``--http-clients process``: the function agent the Rollouter calls, handing each episode to the
    clients' own process (`_client_main`) over a Unix socket, one JSON line each way; `cpu_s`: that
    process's CPU so far; `aclose` stops it."""

    def __init__(self, args: argparse.Namespace, counts: dict):
        import multiprocessing

        self.counts = counts
        self._dir = tempfile.mkdtemp(prefix="asyncrl-bench-http-")
        path = os.path.join(self._dir, "clients.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(1)
        self._listener.setblocking(False)
        self._proc = multiprocessing.get_context("spawn").Process(
            target=_client_main, args=(path, args.agent_turns, args.tool_median_s, args.tool_p99_s, args.seed,
                                       args.event_loop), name="bench-http-clients", daemon=True)
        self._proc.start()  # (before the run: its start-up is not in the measured window)
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._next = 0
        self._connecting: asyncio.Lock | None = None

    async def _connect(self) -> asyncio.StreamWriter:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._writer is None:
                conn, _ = await asyncio.wait_for(asyncio.get_running_loop().sock_accept(self._listener), 120)
                reader, self._writer = await asyncio.open_unix_connection(sock=conn)
                self._reading = asyncio.create_task(self._read(reader), name="bench-http-clients-reader")
        return self._writer

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            msg = json.loads(line)
            future = self._pending.pop(msg["id"], None)
            if future is not None and not future.done():
                future.set_result(msg)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(RuntimeError("the clients' process went away"))

    async def _ask(self, msg: dict) -> dict:
        writer = await self._connect()
        self._next += 1
        msg["id"] = self._next
        future = self._pending[msg["id"]] = asyncio.get_running_loop().create_future()
        writer.write((json.dumps(msg) + "\n").encode())
        try:
            return await future
        except asyncio.CancelledError:  # (the episode's wall time, a stop): its client stops too
            self._pending.pop(msg["id"], None)
            writer.write((json.dumps({"op": "cancel", "of": msg["id"]}) + "\n").encode())
            raise

    async def __call__(self, row: dict, client) -> float:
        self.counts["live"] += 1
        try:
            out = await self._ask({"op": "episode", "row": row, "base_url": client.base_url,
                                   "api_key": client.api_key, "model": client.model})
        finally:
            self.counts["live"] -= 1
        if "error" in out:
            raise RuntimeError(f"the episode's client: {out['error']}")
        self.counts["tool_calls"] += out["tool_calls"]  # (at the episode's end)
        return out["reward"]

    async def cpu_s(self) -> float:
        return (await self._ask({"op": "cpu"}))["cpu_s"]

    async def aclose(self) -> None:
        if self._writer is not None:
            self._writer.write(b'{"op": "exit"}\n')
            await self._writer.drain()
            await asyncio.gather(self._reading, return_exceptions=True)
            self._writer.close()
        await asyncio.to_thread(self._proc.join, 30)
        if self._proc.is_alive():
            self._proc.terminate()
            await asyncio.to_thread(self._proc.join, 10)
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _client_main(path: str, turns: int, median_s: float, p99_s: float, seed: int, event_loop: str) -> None:
    """The clients' process: runs `HttpAgent` episodes as `ClientProcess` asks, until it says exit."""
    import aiohttp  # noqa: F401  (now, before the run: its import is not in the measured window)
    import bench_scale_agent as bench

    bench.run_on(bench.event_loop(event_loop), _serve_clients(path, turns, bench.ToolLatency(median_s, p99_s, seed)))


async def _serve_clients(path: str, turns: int, latency) -> None:
    from types import SimpleNamespace

    reader, writer = await asyncio.open_unix_connection(path)
    agent = HttpAgent(turns, latency, {"live": 0, "tool_calls": 0})
    tasks: dict[int, asyncio.Task] = {}

    async def episode(msg: dict) -> None:
        try:
            reply = {"id": msg["id"], "reward": 1.0, "tool_calls": await agent.run(msg["row"], SimpleNamespace(**msg))}
        except Exception as e:  # (its episode fails: the Rollouter counts it)
            reply = {"id": msg["id"], "error": f"{type(e).__name__}: {e}"}
        finally:
            tasks.pop(msg["id"], None)
        writer.write((json.dumps(reply) + "\n").encode())

    while line := await reader.readline():
        msg = json.loads(line)
        if msg["op"] == "episode":
            tasks[msg["id"]] = asyncio.create_task(episode(msg))
        elif msg["op"] == "cancel" and msg["of"] in tasks:
            tasks[msg["of"]].cancel()
        elif msg["op"] == "cpu":
            writer.write((json.dumps({"id": msg["id"], "cpu_s": time.process_time()}) + "\n").encode())
        elif msg["op"] == "exit":
            break
    for task in list(tasks.values()):
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    await agent.aclose()
    writer.close()


def http_agent(args: argparse.Namespace, counts: dict):
    """The Rollouter's `Agent`: an `EndpointLoop` over `HttpAgent` (``--http-clients loop``) or
    `ClientProcess`, whose ``cpu_s`` the bench reads as the clients' CPU (``client_cpu``)."""
    from bench_scale_agent import ToolLatency

    from asyncrl.agent.endpoint import EndpointLoop, EpisodeLimits
    from asyncrl.models.tiny_chat import build_chat_tokenizer
    from asyncrl.rollouter.agents import Agent

    if args.http_clients == "process":
        fn = ClientProcess(args, counts)
    else:
        fn = HttpAgent(args.agent_turns, ToolLatency(args.tool_median_s, args.tool_p99_s, args.seed), counts)
    loop = EndpointLoop(build_chat_tokenizer(), function=fn, limits=EpisodeLimits(
        max_calls=args.agent_turns, max_tokens_per_call=128, max_context_tokens=8192, max_episode_s=600),
        server=args.endpoint_server, function_in="caller")  # (the clients stay where --http-clients puts them)
    original = loop.aclose

    async def aclose() -> None:
        await original()
        await fn.aclose()

    loop.aclose = aclose
    agent = Agent(loop, "bench_scale --agent --http")
    agent.client_cpu = getattr(fn, "cpu_s", None)
    if args.endpoint_server == "process":

        async def endpoint_stats() -> dict:
            await loop.start()  # (its process starts before the measured window)
            return await loop.host.stats()

        agent.endpoint_stats = endpoint_stats
    return agent


def _rounded(x: float | None) -> float | None:
    """(None: the endpoint's process had no lag tick or collection in a window that short)"""
    return None if x is None else round(x, 3)


def main(args: argparse.Namespace, ray_replicas=None) -> dict:
    """One in-process run, then one over HTTP; the JSON described in the module docstring.
    ``ray_replicas``: as `bench_scale_agent.agent_run`'s."""
    import bench_scale_agent as bench

    loop_name = bench.event_loop(args.event_loop)
    inprocess = bench.run_on(loop_name, bench.agent_run(args, ray_replicas=ray_replicas))
    print(f"in-process: {bench.report(inprocess)}", flush=True)
    http = bench.run_on(loop_name, bench.agent_run(args, make_agent=http_agent, ray_replicas=ray_replicas))
    print(f"http: {bench.report(http)}", flush=True)
    rollouter_cpu, endpoint_cpu, clients = http["cpu_ms_per_turn"], http["endpoint_cpu_ms_per_turn"], http["client_cpu_ms_per_turn"]
    server = rollouter_cpu + endpoint_cpu
    process = args.endpoint_server == "process"
    endpoint_lag = http["endpoint_lag_p99_ms"] if process else http["loop_lag_p99_ms"]
    endpoint_gc = http["endpoint_gc_pause_max_ms"] if process else http["gc_pause_max_ms"]
    result = {"http": True, "episodes": http["conversations_sent"], "loop_lag_p99_ms": round(http["loop_lag_p99_ms"], 3),
              "endpoint_server": args.endpoint_server, "endpoint_loop_lag_p99_ms": _rounded(endpoint_lag),
              "endpoint_gc_pause_max_ms": _rounded(endpoint_gc),
              "cpu_ms_per_call_rollouter": round(rollouter_cpu, 3), "cpu_ms_per_call_endpoint_process": round(endpoint_cpu, 3),
              "calls_s": round(http["turn_req_s"], 1), "cpu_ms_per_call": round(server + clients, 3),
              "cpu_ms_per_call_server": round(server, 3), "cpu_ms_per_call_clients": round(clients, 3),
              "cpu_ms_per_call_inprocess": round(inprocess["cpu_ms_per_turn"], 3), "lost": http["lost"],
              "duplicated": http["duplicated"], "bad_turns": http["bad_turns"], "failed": http["failed"],
              "concurrent": args.agent_conversations, "calls_per_episode": args.agent_turns,
              "http_clients": args.http_clients, "loop_lag_max_ms": round(http["loop_lag_max_ms"], 3),
              "gc_pause_max_ms": round(http["gc_pause_max_ms"], 3), "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(f"http: the Rollouter's loop lag p99 {result['loop_lag_p99_ms']} ms (target <= 50; the endpoint on "
          f"{args.endpoint_server!r}, its own loop's p99 {result['endpoint_loop_lag_p99_ms']} ms, GC pause max {result['endpoint_gc_pause_max_ms']} ms), {result['calls_s']} calls/s "
          f"(target >= 1500), CPU {result['cpu_ms_per_call']} ms/call over HTTP (server {result['cpu_ms_per_call_server']}"
          f" = Rollouter {result['cpu_ms_per_call_rollouter']} + endpoint process {result['cpu_ms_per_call_endpoint_process']}, clients "
          f"{result['cpu_ms_per_call_clients']}; clients on {args.http_clients!r}) vs {result['cpu_ms_per_call_inprocess']} "
          f"ms/turn in process; lost {result['lost']} duplicated {result['duplicated']}", flush=True)
    if args.json:
        print(json.dumps(result))
    return result
