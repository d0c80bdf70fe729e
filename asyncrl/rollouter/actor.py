"""``EngineActor``: one inference engine replica behind a Ray async actor.

The class is plain Python (testable in-process); `remote_engine_actor` makes the Ray actor
class from it. Ray runs ``async`` methods concurrently on the actor's event loop, so many
``generate`` calls are in flight at once and the engine batches them. Requests and results
cross Ray as the `asyncrl.types` dataclasses.

The engine is built by kind through the registry (`asyncrl.rollouter.engines.backends.make_engine`:
``torch``, ``vllm``, ``sim``). Weight sync:
``init_weight_sync(ReceiverInit)`` builds the receiver of the record's method
(`asyncrl.sync.backends.make_receiver`: ``broadcast`` for either kind, into vLLM's workers for a
vLLM engine; ``vllm``, vLLM's NCCL engine, for vLLM on GPU) and ``receive_weights`` goes to
it; a method that does not fit the engine's kind is refused.

Dispatch by group: ``generate_group(requests, truncatable, batch_s)`` takes several requests in one
call (a group's ``n``, or the responses of a group resumed in a round) and hands back each one's
result or error as it ends, in batches (an async generator: through Ray a streaming call, one
message per batch); ``generate_all`` is the same in one plain call answered at the end. Responses that end within ``batch_s`` of the batch's first go in it: each
message costs the caller about as much as a Ray call, so a group costs a call and a few messages
instead of ``n`` calls. ``stats()`` adds, over the calls that ended on an engine that says what
each request prefilled (`GenerateResult.prefill_tokens`: the built-in one), ``groups`` (calls:
group calls and single generates), ``group_prompt_tokens`` (the tokens of each call's distinct
prompts: what the engine prefills when it shares a group's prompt perfectly) and
``group_prefill_tokens`` (what it prefilled for them).

Partial rollout: ``generate(request, truncatable=True)`` registers the request for the
aggregator's ``truncate(version)`` signal, which stops every registered request that has
generated tokens in round ``version`` (the engine's abort hands back the partial output);
such a result comes back with ``finish_reason="truncated"``. A registered request still
queued for a slot (or not yet at its first token) is left to run, unless the signal asks for
those too (``queued=True``: the synchronous workflow, where the engines idle until the next
round); it then comes back truncated with no tokens, and so does every truncatable request
that arrives after such a signal, until the engine serves a later version or `reopen`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence

import numpy as np

from asyncrl.calls import maybe_await
from asyncrl.heap import settle_gc
from asyncrl.rollouter.engines.backends import make_engine
from asyncrl.rollouter.engines.base import PauseMode
from asyncrl.rpc import Serving
from asyncrl.types import GenerateRequest, GenerateResult

class EngineActor(Serving):
    """One engine replica; the same methods as `asyncrl.rollouter.engines.base.RolloutEngine`.
    As a Ray actor it also serves its calls over ZeroMQ to processes of its node (`asyncrl.rpc`)."""

    def __init__(self, kind: str = "torch", num_threads: int | None = None, **engine_kwargs):
        from asyncrl.hang import enable_stack_dumps

        enable_stack_dumps()  # the launcher's hang watchdog asks every process where it waits
        if num_threads is not None:
            import torch

            # Actors sharing a machine share its cores: cap torch's intra-op threads.
            torch.set_num_threads(num_threads)
        self.kind = kind
        self.engine = make_engine(kind, **engine_kwargs)
        self._receiver = None
        self._truncatable: set[str] = set()
        self._truncated: set[str] = set()
        self._closed_round: int | None = None
        """The round a ``queued`` truncation closed: truncatable requests of it are not started."""
        self._calls = dict(groups=0, group_prompt_tokens=0, group_prefill_tokens=0)
        if _in_ray_actor():  # the actor's process is set up: keep full collections off its event loop
            settle_gc()

    async def ready(self) -> dict:
        """Returns once the engine is built: ``{"kind", "version"}``."""
        return {"kind": self.kind, "version": self.engine.version}

    async def generate_group(self, requests: Sequence[GenerateRequest], truncatable: bool = False,
                             batch_s: float | None = 0.0) -> AsyncIterator[list[tuple[int, GenerateResult | Exception]]]:
        """Several requests at once; yields ``[(i, result or the exception it raised), ...]`` as they
        end, those that end within ``batch_s`` of a batch's first together (None: all in one batch)."""
        if len(requests) == 1:  # (an agent turn, a resumed response): no task, no wait
            try:
                outcome = await self._generate(requests[0], truncatable)
            except Exception as exc:  # noqa: BLE001 - handed back as the request's outcome, as below
                outcome = exc
            self._count(requests, [outcome])
            yield [(0, outcome)]
            return
        tasks = {asyncio.ensure_future(self._generate(r, truncatable)): i for i, r in enumerate(requests)}
        pending, outcomes = set(tasks), []
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if pending and (batch_s is None or batch_s > 0):
                    more, pending = await asyncio.wait(pending, timeout=batch_s)
                    done |= more
                batch = [(tasks[t], t.exception() or t.result()) for t in sorted(done, key=tasks.__getitem__)]
                outcomes += [o for _, o in batch]
                if not pending:  # counted before the last batch leaves: its reader may look at once
                    self._count(requests, outcomes)
                yield batch
        finally:
            for t in pending:
                t.cancel()

    async def generate_all(self, requests: Sequence[GenerateRequest],
                           truncatable: bool = False) -> list[tuple[int, GenerateResult | Exception]]:
        """`generate_group` answered in one message, once the last request ends (a plain Ray call:
        about a third of a streaming call's cost to the caller)."""
        return [item async for batch in self.generate_group(requests, truncatable, None) for item in batch]

    async def generate(self, request: GenerateRequest, truncatable: bool = False) -> GenerateResult:
        """One response; a ``truncatable`` one may be stopped by `truncate` (``finish_reason="truncated"``)."""
        result = await self._generate(request, truncatable)
        self._count([request], [result])
        return result

    def _count(self, requests: Sequence[GenerateRequest], outcomes: list) -> None:
        """A call ended: count it when the engine said what each request prefilled (the built-in one does)."""
        if not all(isinstance(o, GenerateResult) and o.prefill_tokens is not None for o in outcomes):
            return
        self._calls["groups"] += 1
        self._calls["group_prompt_tokens"] += sum(len(p) for p in {r.prompt_ids.tobytes(): r.prompt_ids
                                                                    for r in requests}.values())
        self._calls["group_prefill_tokens"] += sum(o.prefill_tokens for o in outcomes)

    async def _generate(self, request: GenerateRequest, truncatable: bool) -> GenerateResult:
        if not truncatable:
            return await self.engine.generate(request)
        rid = request.request_id
        if self._closed_round is not None and self._closed_round == self.engine.version:
            # On its way while the round ended: it waits for the next round like the others.
            return GenerateResult(rid, np.zeros(0, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int64),
                                  finish_reason="truncated")
        self._truncatable.add(rid)
        try:
            result = await self.engine.generate(request)
        finally:
            self._truncatable.discard(rid)
        if rid in self._truncated:
            self._truncated.discard(rid)
            if result.finish_reason == "abort":
                result.finish_reason = "truncated"
        return result

    async def truncate(self, version: int, queued: bool = False) -> int:
        """End round ``version``: stop every truncatable request that has generated tokens, with
        its partial output.

        A request still queued for a slot has nothing to hand back: it keeps its place and runs
        when a stopped one frees its slot (stopping it would only leave it, and the engine, waiting
        for the next round), unless ``queued``: then it stops too, with no tokens. Ignored
        (returns 0) once the engine serves a later version: that round is over. Returns how many
        requests were stopped.
        """
        if self.engine.version != version:
            return 0
        if queued:
            self._closed_round = version
        if not self._truncatable:
            return 0
        ids = [rid for rid, n in self.engine.progress(self._truncatable).items() if n > 0 or queued]
        if ids:
            self._truncated.update(ids)
            await self.engine.abort(ids)
        return len(ids)

    async def reopen(self, version: int) -> None:
        """Round ``version`` goes on after a ``queued`` truncation (the step lacks groups again):
        truncatable requests start again."""
        if self._closed_round == version:
            self._closed_round = None

    async def pause(self, mode: PauseMode = "keep", clear_cache: bool = False) -> None:
        await self.engine.pause(mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        await self.engine.resume()

    async def end_session(self, session_id: str) -> None:
        await self.engine.end_session(session_id)

    async def abort(self, request_ids: Iterable[str]) -> None:
        await self.engine.abort(list(request_ids))

    async def wait_for_tokens(self, request_id: str, n_tokens: int, timeout_s: float = 60.0) -> int:
        """The engine's progress hook (built-in engine only): see `TorchEngine.wait_for_tokens`."""
        return await self.engine.wait_for_tokens(request_id, n_tokens, timeout_s=timeout_s)

    async def version(self) -> int:
        return self.engine.version

    async def stats(self) -> dict[str, int]:
        """The engine's counters, with this actor's ``groups`` and ``group_prompt_tokens``."""
        return {**self.engine.stats(), **self._calls}

    async def param_meta(self) -> list:
        return self.engine.param_meta()

    async def load_weights(self, named_tensors) -> None:
        await self.engine.load_weights(named_tensors)

    async def finish_weight_update(self, version: int) -> None:
        await self.engine.finish_weight_update(version)

    async def weight_dtype(self) -> str:
        """The dtype the engine holds its weights in (``vllm``: what the sync sends by default)."""
        if self.kind == "vllm":
            return self.engine.weight_dtype()
        from asyncrl.sync.wire import dtype_name

        return dtype_name(next(d for _, d, _ in self.engine.param_meta() if d.is_floating_point))

    async def init_weight_sync(self, init):
        """Join the weight-sync group described by ``init`` (this engine's `ReceiverInit`)."""
        from asyncrl.sync.backends import make_receiver

        receiver = make_receiver(self.engine, init, engine_kind=self.kind)  # refuses a method the kind lacks
        if self._receiver is not None:
            await maybe_await(self._receiver.close())
        self._receiver = receiver
        return await self._receiver.connect()

    async def receive_weights(self, **kwargs):
        if self._receiver is None:
            raise RuntimeError("receive_weights before init_weight_sync: call init_weight_sync first")
        return await self._receiver.receive(**kwargs)

    async def close(self) -> None:
        self.close_rpc()
        if self._receiver is not None:
            await maybe_await(self._receiver.close())
        await self.engine.close()


def _in_ray_actor() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def remote_engine_actor(num_cpus: float = 1, num_gpus: float = 0, **options):
    """The Ray actor class of `EngineActor`: ``remote_engine_actor().remote(kind="torch", model_path=...)``."""
    import ray

    # Async actor: default max_concurrency (1000) lets every generate call be in flight.
    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, **options)(EngineActor)
