"""``rollout.agent.endpoint_server: process``: the endpoint in a process of its own next to the Rollouter.

`ProcessHost` (the Rollouter's side) starts ``python -m asyncrl.agent.endpoint.process <fd>`` with
one end of a socket pair (`asyncrl.agent.endpoint.channel`) and hands it the renderer, the limits,
where to bind and the agent function (by name; None for a command agent). That process runs the
`EndpointServer`, every `Episode` with its history, and the agent function of each episode;
each call's generation comes back to the Rollouter as a ``generate`` call on the episode's `LLM`
(its pause-keep across a sync, its versions, its partial rollout and skip replay are the
Rollouter's as with ``loop``); a call the HTTP client gives up is cancelled on both sides (its
engine request aborted). Why: the Rollouter's event loop then holds only the engine calls, not
the HTTP requests, bodies and histories of ~1,000 calls in flight, whose walks by Python's
collector were the loop's lag tail (docs/benchmarks.md); and the agents' own clients spend their
CPU, and block their loop if they block, here.

The process exits when its socket closes (the Rollouter stopped or died: nothing else holds it);
`ProcessHost.aclose` asks it to stop, waits, and kills it by pid if it does not. If it dies
during a run, every episode open on it fails its group naming its exit code, and the next
episode starts a new one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
import traceback
from typing import Any

import numpy as np

from asyncrl.agent.base import LLM, AgentTrajectory, Turn
from asyncrl.agent.endpoint.channel import Channel, ChannelClosed
from asyncrl.agent.endpoint.episode import EpisodeLimits
from asyncrl.agent.endpoint.host import EndpointHost, EpisodeRecord, HostGone, LoopHost

log = logging.getLogger("asyncrl.agent.endpoint")

_START_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 30.0


class ProcessHost(EndpointHost):
    """The endpoint served from a child process (the module docstring)."""

    def __init__(self, renderer: Any, limits: EpisodeLimits, model: str, host: str, port: int, *,
                 function: Any = None, name: str = "the agent function"):
        self.function = function
        self.settings = {"renderer": renderer, "limits": limits, "model": model, "host": host, "port": port,
                         "function": function, "name": name}
        self.proc: asyncio.subprocess.Process | None = None
        self.channel: Channel | None = None
        self._reading: asyncio.Task | None = None
        self._llms: dict[str, LLM] = {}
        self._restarting: asyncio.Lock | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    async def start(self) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "asyncrl.agent.endpoint.process", str(theirs.fileno()),
                pass_fds=(theirs.fileno(),), env=env, stdin=asyncio.subprocess.DEVNULL)
        finally:
            theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        self.channel = Channel(reader, writer, {"generate": self._generate}, peer="the endpoint process")
        self._reading = asyncio.create_task(self.channel.serve(), name="asyncrl-endpoint-channel")
        try:
            import cloudpickle  # (the renderer may hold closures: its decoder; a module's function goes by name)

            blob = cloudpickle.dumps(self.settings)
            self.url = await asyncio.wait_for(self.channel.call("start", blob), _START_TIMEOUT_S)
        except ChannelClosed:
            gone = await self._gone()
            await self.aclose()
            raise gone from None
        except BaseException:
            await self.aclose()
            raise

    async def _gone(self) -> HostGone:
        """What failed: the process's exit code (once it is known)."""
        if self.proc is not None and self.proc.returncode is None:
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except TimeoutError:
                pass
        code = None if self.proc is None else self.proc.returncode
        return HostGone(f"the endpoint process (pid {self.pid}) exited with code {code}: its open episodes fail "
                        "their groups")

    def _up(self) -> bool:
        return self.channel is not None and self.channel.closed is None

    async def _generate(self, episode_id: str, context: bytes, max_tokens: int, stop: tuple) -> tuple:
        llm = self._llms.get(episode_id)
        if llm is None:
            raise RuntimeError(f"episode {episode_id} is not open in the Rollouter")
        turn = await llm.generate(np.frombuffer(context, np.int64), max_tokens=max_tokens, stop=stop)
        return _turn_out(turn)

    async def open(self, episode_id: str, llm: LLM) -> str:
        if not self._up():  # it died: episodes from now on run on a new one
            if self._restarting is None:
                self._restarting = asyncio.Lock()
            async with self._restarting:
                if not self._up():
                    log.warning("%s; starting a new endpoint process", await self._gone())
                    await self.aclose()
                    await self.start()
        self._llms[episode_id] = llm
        try:
            return await self.channel.call("open", episode_id)
        except BaseException as e:
            self._llms.pop(episode_id, None)
            if isinstance(e, ChannelClosed):
                raise await self._gone() from None
            raise

    async def drive(self, episode_id: str, row: dict, spec: Any) -> float | None:
        try:
            return await self.channel.call("drive", episode_id, row, spec)
        except ChannelClosed:
            raise await self._gone() from None

    async def close(self, episode_id: str, why: str, branches: str) -> EpisodeRecord:
        try:
            if not self._up():
                raise await self._gone()
            return _record_in(await self.channel.call("close", episode_id, why, branches))
        except ChannelClosed:
            raise await self._gone() from None
        finally:
            self._llms.pop(episode_id, None)

    async def stats(self) -> dict:
        """The process's CPU seconds so far, its event loop's lag ticks and its collector's pauses since
        the last call (kept from the first call on: ``bench_scale.py --agent --http``)."""
        return await self.channel.call("stats")

    async def aclose(self) -> None:
        if self.channel is not None and self.channel.closed is None:
            try:
                await asyncio.wait_for(self.channel.call("stop"), _STOP_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - it is stopped below either way (EOF, then a kill)
                log.debug("the endpoint process did not answer its stop: %s", e)
            self.channel.close("the Rollouter closed it")
        if self._reading is not None:
            await asyncio.gather(self._reading, return_exceptions=True)
            self._reading = None
        if self.proc is not None:
            try:
                await asyncio.wait_for(self.proc.wait(), _STOP_TIMEOUT_S)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self.channel = None


class _Served:
    """The endpoint process's side: the server and its episodes, served over the channel."""

    def __init__(self) -> None:
        self.host: LoopHost | None = None
        """The server and its episodes, on this process's loop."""
        self.channel: Channel | None = None
        self.stopped = asyncio.Event()
        self.measuring = False
        """`stats` was called: the loop's lag and the collector's pauses are being kept (for the bench)."""
        self.lags: list[float] = []
        self.gc_ms: list[float] = []
        self._gc_t0 = 0.0

    async def start(self, blob: bytes) -> str:
        import cloudpickle

        from asyncrl.heap import settle_gc

        s = cloudpickle.loads(blob)
        settle_gc()  # what start-up built is frozen out of the collections; the young generation collected rarely
        self.host = LoopHost(s["renderer"], s["limits"], s["model"], s["host"], s["port"], function=s["function"],
                             name=s["name"])
        await self.host.start()
        return self.host.url

    async def open(self, episode_id: str) -> str:
        return await self.host.open(episode_id, _RemoteLLM(self.channel, episode_id))

    async def drive(self, episode_id: str, row: dict, spec: Any) -> float | None:
        try:
            return await self.host.drive(episode_id, row, spec)
        except Exception as e:  # its traceback, which stays here, goes with it as a note
            e.add_note("".join(traceback.format_exception(e)).rstrip())
            raise

    async def close(self, episode_id: str, why: str, branches: str) -> tuple:
        return _record_out(await self.host.close(episode_id, why, branches))

    async def stats(self) -> dict:
        """CPU seconds so far; the loop's lag ticks and the collector's pauses since the last call (ms)."""
        if not self.measuring:
            import gc

            self.measuring = True
            gc.callbacks.append(self._gc_timer)
            asyncio.create_task(self._lag_ticks(), name="asyncrl-endpoint-lag")
        lags, self.lags = self.lags, []
        pauses, self.gc_ms = self.gc_ms, []
        return {"cpu_s": time.process_time(), "lags_ms": lags, "gc_pauses_ms": pauses}

    def _gc_timer(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gc_ms.append((time.perf_counter() - self._gc_t0) * 1e3)

    async def stop(self) -> None:
        self.stopped.set()

    async def _lag_ticks(self) -> None:
        """How late this loop wakes from a 10 ms sleep (kept until `stats` takes them; only once it was asked)."""
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.01)
            self.lags.append(max(0.0, loop.time() - t - 0.01) * 1e3)  # uvloop's ms timers may wake early: 0
            if len(self.lags) > 100_000:
                del self.lags[:50_000]


class _RemoteLLM:
    """An episode's `LLM` in the endpoint process: each generation is the Rollouter's."""

    def __init__(self, channel: Channel, episode_id: str):
        self.channel, self.episode_id = channel, episode_id

    async def generate(self, context, *, max_tokens: int, stop: tuple = ()) -> Turn:
        ids = np.ascontiguousarray(context, np.int64).tobytes()
        return _turn_in(await self.channel.call("generate", self.episode_id, ids, max_tokens, tuple(stop)))


# A call's ids and its turn cross as the arrays' bytes: a pickled array costs several times more.
def _turn_out(turn: Turn) -> tuple:
    return (np.ascontiguousarray(turn.token_ids, np.int64).tobytes(), np.ascontiguousarray(turn.logprobs, np.float32).tobytes(),
            np.ascontiguousarray(turn.versions, np.int64).tobytes(), turn.finish_reason)


def _turn_in(blob: tuple) -> Turn:
    ids, logprobs, versions, finish = blob
    return Turn(np.frombuffer(ids, np.int64), np.frombuffer(logprobs, np.float32), np.frombuffer(versions, np.int64), finish)


# An ended episode crosses as a tuple, its trajectories' arrays as bytes: pickling the record's
# dataclasses and arrays was ~5% of the endpoint process's CPU on the bench. Field order comes from
# the dataclasses themselves, so a field added to either crosses too.
_TRAJECTORY_ARRAYS = (("prompt_ids", np.int64), ("response_ids", np.int64), ("loss_mask", np.uint8),
                      ("logprobs", np.float32), ("versions", np.int64))
_TRAJECTORY_REST = tuple(f.name for f in dataclasses.fields(AgentTrajectory) if f.name not in dict(_TRAJECTORY_ARRAYS))
_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(EpisodeRecord))


def _record_out(r: EpisodeRecord) -> tuple:
    trajectories = [(tuple(np.ascontiguousarray(getattr(t, k), dt).tobytes() for k, dt in _TRAJECTORY_ARRAYS),
                     tuple(getattr(t, k) for k in _TRAJECTORY_REST)) for t in r.trajectories]
    return tuple(trajectories if k == "trajectories" else getattr(r, k) for k in _RECORD_FIELDS)


def _record_in(blob: tuple) -> EpisodeRecord:
    """(Writable arrays, as a pickled record's were: a trainer may hand them to torch as they are.)"""
    fields = dict(zip(_RECORD_FIELDS, blob))
    fields["trajectories"] = [
        AgentTrajectory(**{k: np.frombuffer(b, dt).copy() for b, (k, dt) in zip(arrays, _TRAJECTORY_ARRAYS)},
                        **dict(zip(_TRAJECTORY_REST, rest)))
        for arrays, rest in fields["trajectories"]]
    return EpisodeRecord(**fields)


async def _serve(fd: int) -> None:
    served = _Served()
    reader, writer = await asyncio.open_connection(sock=socket.socket(fileno=fd))
    served.channel = channel = Channel(reader, writer, {"start": served.start, "open": served.open, "drive": served.drive,
                                                        "close": served.close, "stats": served.stats, "stop": served.stop},
                                       peer="the Rollouter")
    reading = asyncio.create_task(channel.serve())
    stopping = asyncio.create_task(served.stopped.wait())
    await asyncio.wait([reading, stopping], return_when=asyncio.FIRST_COMPLETED)
    if served.host is not None:
        await served.host.aclose()
    channel.close("the endpoint process stopped")
    await asyncio.gather(reading, return_exceptions=True)
    stopping.cancel()


def main(argv: list[str] | None = None) -> None:
    """``python -m asyncrl.agent.endpoint.process <fd>``: serve until the socket at ``fd`` closes."""
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the run reaches the Rollouter, which closes us
    try:  # uvloop where installed (asyncrl depends on it), as Ray gives the Rollouter's actor
        import uvloop
    except ImportError:
        asyncio.run(_serve(int(argv[0])))
    else:
        uvloop.run(_serve(int(argv[0])))


if __name__ == "__main__":
    main()
