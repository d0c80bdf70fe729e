"""``bench_scale.py --agent --http``: the ``--agent`` bench with every episode an OpenAI-client agent
calling its endpoint over real HTTP (`asyncrl.agent.endpoint`), beside the in-process `EnvLoop` path.

Each episode is a function agent (an ``aiohttp`` client, one connection pool for all): it makes
``--agent-turns`` chat calls with a tool schema, echoing each answer back, with a simulated tool
call between two calls (the same seeded log-normal latency as ``--agent``). The endpoint serves it
on the Rollouter's event loop over the simulated replicas. The clients run on that same loop (one
process), so the lag and the CPU per call are upper bounds: they include the client side of HTTP.

First the in-process path runs (``cpu_ms_per_call_inprocess``: CPU per model turn of `EnvLoop`),
then the HTTP one; the JSON's last line has ``http: true``, ``episodes``, ``loop_lag_p99_ms``,
``calls_s``, ``cpu_ms_per_call``, ``cpu_ms_per_call_inprocess``, ``lost``, ``duplicated``.

    python scripts/bench_scale.py --agent --http --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http", action="store_true",
                   help="with --agent: every episode an OpenAI-client agent over real HTTP (bench_scale_http)")


class HttpAgent:
    """The function agent of every episode (see the module docstring); `aclose` closes its connection pool."""

    def __init__(self, turns: int, latency, counts: dict):
        self.turns, self.latency, self.counts = turns, latency, counts
        self.session = None

    async def __call__(self, row: dict, client) -> float:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                 timeout=aiohttp.ClientTimeout(total=600))
        self.counts["live"] += 1
        headers = {"Authorization": f"Bearer {client.api_key}"}
        messages = [{"role": "user", "content": row["prompt"]}]
        tools = [{"type": "function", "function": {"name": "lookup", "description": "look up",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        try:
            for turn in range(self.turns):
                async with self.session.post(f"{client.base_url}/chat/completions", headers=headers,
                                             json={"model": client.model, "messages": messages, "tools": tools}) as r:
                    body = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {body}")
                if turn == self.turns - 1:
                    break
                await asyncio.sleep(self.latency.draw())  # the tool
                self.counts["tool_calls"] += 1
                messages += [body["choices"][0]["message"], {"role": "tool", "name": "lookup", "content": "42"}]
        finally:
            self.counts["live"] -= 1
        return 1.0

    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()


def http_agent(args: argparse.Namespace, counts: dict):
    """The Rollouter's `Agent`: an `EndpointLoop` over `HttpAgent`."""
    from bench_scale_agent import ToolLatency

    from asyncrl.agent.endpoint import EndpointLoop, EpisodeLimits
    from asyncrl.models.tiny_chat import build_chat_tokenizer
    from asyncrl.rollouter.agents import Agent

    fn = HttpAgent(args.agent_turns, ToolLatency(args.tool_median_s, args.tool_p99_s, args.seed), counts)
    loop = EndpointLoop(build_chat_tokenizer(), function=fn, limits=EpisodeLimits(
        max_calls=args.agent_turns, max_tokens_per_call=128, max_context_tokens=8192, max_episode_s=600))
    original = loop.aclose

    async def aclose() -> None:
        await original()
        await fn.aclose()

    loop.aclose = aclose
    return Agent(loop, "bench_scale --agent --http")


def main(args: argparse.Namespace, ray_replicas=None) -> dict:
    """One in-process run, then one over HTTP; the JSON described in the module docstring.
    ``ray_replicas``: as `bench_scale_agent.agent_run`'s."""
    import bench_scale_agent as bench

    loop_name = bench.event_loop(args.event_loop)
    inprocess = bench.run_on(loop_name, bench.agent_run(args, ray_replicas=ray_replicas))
    print(f"in-process: {bench.report(inprocess)}", flush=True)
    http = bench.run_on(loop_name, bench.agent_run(args, make_agent=http_agent, ray_replicas=ray_replicas))
    print(f"http: {bench.report(http)}", flush=True)
    result = {"http": True, "episodes": http["conversations_sent"], "loop_lag_p99_ms": round(http["loop_lag_p99_ms"], 3),
              "calls_s": round(http["turn_req_s"], 1), "cpu_ms_per_call": round(http["cpu_ms_per_turn"], 3),
              "cpu_ms_per_call_inprocess": round(inprocess["cpu_ms_per_turn"], 3), "lost": http["lost"],
              "duplicated": http["duplicated"], "bad_turns": http["bad_turns"], "failed": http["failed"],
              "concurrent": args.agent_conversations, "calls_per_episode": args.agent_turns,
              "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(f"http: loop lag p99 {result['loop_lag_p99_ms']} ms (target <= 50), {result['calls_s']} calls/s (target >= "
          f"1500), CPU {result['cpu_ms_per_call']} ms/call over HTTP vs {result['cpu_ms_per_call_inprocess']} ms/turn "
          f"in process; lost {result['lost']} duplicated {result['duplicated']}", flush=True)
    if args.json:
        print(json.dumps(result))
    return result
