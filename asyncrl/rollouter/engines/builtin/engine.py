"""The built-in inference engine: continuous batching over any Hugging Face causal LM.

``TorchEngine`` implements `asyncrl.rollouter.engines.base.RolloutEngine` in-process on asyncio.
One scheduler task, owned by the engine, repeats a *step* under the engine's lock:

1. admit queued requests while fewer than ``max_running`` run (requests that came to a small
   batch first wait ``batch_wait_ms`` for others, so that they start in one step);
2. run ONE forward over every running request: the newly admitted ones feed their prompt
   (the ``n`` requests of a group share one prefill), the others their last token, each into
   its own blocks of the paged KV cache (`asyncrl.rollouter.engines.builtin.kv_cache`), with
   per-row positions and a 4-d mask; sample one token per request (`model_runner`, `sampling`);
3. append tokens, finish requests on a stop token / ``max_tokens`` / the context limit, and
   hand results back. Requests join and leave between steps: continuous batching.

Steps run in a worker thread, back to back until one needs the event loop (`ModelRunner.run_steps`);
all else (pause, abort, weight loads, new requests) takes the lock, between two steps. An engine
lives on the event loop of its first call (its scheduler task). Where a step's time goes: ``docs/engine.md``.

Log-probs: ``log_softmax(logits / T)[token]`` of the sampled token under the weights that produced
it, after temperature and before top-k/top-p (greedy: ``T = 1``): vLLM's
``logprobs_mode="processed_logprobs"`` when top-k/top-p are off, and what a trainer's full forward gives.

Pause modes are vLLM's (`asyncrl.rollouter.engines.base`): ``abort`` ends everything now, ``wait``
drains and refuses new requests, ``keep`` freezes running requests with their KV cache and queues
new ones; ``clear_cache=True`` drops the KV, re-prefilled on resume (``stats()["reprefill_tokens"]``).
Conversations: a turn with a ``session_id`` that ends keeps its KV blocks; the next turn, on the
same weights and extending the kept tokens, prefills only its new ones (`sessions`). Left out: prefix
caching across groups and sessions, chunked prefill, speculative decoding, tensor parallelism.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import torch

from asyncrl.rollouter.engines.base import (
    PAUSE_MODES,
    EngineClosedError,
    EngineError,
    EnginePausedError,
    PauseMode,
    engine_config,
)
from asyncrl.rollouter.engines.builtin.config import TorchEngineConfig
from asyncrl.rollouter.engines.builtin.model_runner import ModelRunner, Sequence
from asyncrl.types import GenerateRequest, GenerateResult


class TorchEngine:
    """Continuous-batching engine over a Hugging Face causal LM (see the module docstring)."""

    def __init__(self, model_path: str | Path | None = None, *, config: TorchEngineConfig | None = None, **kwargs):
        self.config = config = engine_config(TorchEngineConfig, model_path, config, kwargs)
        from transformers import AutoModelForCausalLM

        extra = {"attn_implementation": config.attn_implementation} if config.attn_implementation else {}
        self.model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=config.dtype, **extra)
        self.model.to(config.device).eval()
        self.model.requires_grad_(False)
        mcfg = self.model.config
        self.max_model_len = config.max_model_len or int(getattr(mcfg, "max_position_embeddings", 2048))
        if config.eos_token_ids is not None:
            self._eos = frozenset(config.eos_token_ids)
        else:
            eos = mcfg.eos_token_id
            self._eos = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        self._runner = ModelRunner(self.model, config.device, config.seed, config.decoder,
                                   session_idle_s=config.session_idle_s, session_max_blocks=config.session_max_blocks)
        self._version = 0
        self._queued: deque[Sequence] = deque()
        self._running: dict[str, Sequence] = {}
        self._paused: PauseMode | None = None
        self._closed = False
        self._failure: BaseException | None = None
        self._counters = dict(requests=0, tokens_generated=0, reprefill_tokens=0, prefill_tokens=0,
                              shared_prefill_tokens=0, steps=0)
        self._cond: asyncio.Condition | None = None
        self._task: asyncio.Task | None = None
        self._waiting = 0  # callers waiting for the lock: the worker's run of steps ends for them

    # ---------------------------------------------------------------- lifecycle

    def _start(self) -> asyncio.Condition:
        # The scheduler starts on first use, inside the caller's running loop (a Ray async
        # actor builds its engine outside the loop).
        if self._cond is None:
            self._cond = asyncio.Condition()
            self._task = asyncio.get_running_loop().create_task(self._schedule(), name="torch-engine-scheduler")
        return self._cond

    @contextlib.asynccontextmanager
    async def _locked(self):
        """The engine's lock, counted while awaited: steps run back to back only while nobody waits."""
        cond = self._start()
        self._waiting += 1
        try:
            await cond.acquire()
        finally:
            self._waiting -= 1
        try:
            yield cond
        finally:
            cond.release()

    async def close(self) -> None:
        """Stop the scheduler; requests still in flight end with `EngineClosedError`."""
        if self._closed:
            return
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_all(EngineClosedError("the engine was closed"))
        self._runner.drop_kv()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine was closed")
        if self._failure is not None:
            raise EngineError(f"the engine's scheduler failed: {self._failure!r}") from self._failure

    # ---------------------------------------------------------------- requests

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Generate one response; waits while the engine is paused with ``keep``."""
        self._check_open()
        prompt = request.prompt_ids.tolist()
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt of {len(prompt)} tokens does not fit "
                f"max_model_len={self.max_model_len}"
            )
        async with self._locked() as cond:
            self._check_open()
            if self._paused in ("abort", "wait"):
                raise EnginePausedError(
                    f"request {request.request_id} refused: the engine is paused with mode={self._paused!r}; "
                    "call resume() first"
                )
            if request.request_id in self._running or any(s.rid == request.request_id for s in self._queued):
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            seq = Sequence(
                request=request,
                future=asyncio.get_running_loop().create_future(),
                tokens=prompt,
                stop_ids=self._eos | frozenset(request.sampling.stop_token_ids),
            )
            self._queued.append(seq)
            self._counters["requests"] += 1
            cond.notify_all()
        # Cancelling the caller cancels the future; the scheduler then drops the request.
        return await seq.future

    async def end_session(self, session_id: str) -> None:
        """Free the KV blocks kept for ``session_id``'s next turn (a turn of it still running is kept
        when it ends, until the idle timeout ``session_idle_s``); an unknown id is ignored."""
        async with self._locked():
            self._runner.sessions.end(session_id)

    async def abort(self, request_ids: Iterable[str]) -> None:
        """End the named requests now with their partial output; unknown ids are ignored."""
        wanted = set(request_ids)
        async with self._locked() as cond:
            for seq in [s for s in self._queued if s.rid in wanted]:
                self._queued.remove(seq)
                _resolve(seq, seq.result("abort"))
            for rid in wanted & self._running.keys():
                self._finish(self._running[rid], "abort")
            cond.notify_all()

    def progress(self, request_ids: Iterable[str]) -> dict[str, int]:
        """Tokens generated so far by each named request in flight (0 while it is queued for a
        KV slot); ids not in flight are left out."""
        queued = {s.rid for s in self._queued}
        out = {}
        for rid in request_ids:
            seq = self._running.get(rid)
            if seq is not None:
                out[rid] = seq.n_generated
            elif rid in queued:
                out[rid] = 0
        return out

    async def wait_for_tokens(self, request_id: str, n_tokens: int, timeout_s: float = 60.0) -> int:
        """Wait until ``request_id`` has generated ``n_tokens`` or is no longer in flight.

        Returns its token count then (0 once it has left). A hook for tests and benchmarks that
        must act mid-generation; raises `EngineError` naming ``timeout_s`` when it runs out.
        """
        cond = self._start()

        def reached() -> bool:
            seq = self._running.get(request_id)
            if seq is not None:
                return seq.n_generated >= n_tokens
            return not any(s.rid == request_id for s in self._queued)

        # Counted as waiting throughout: the worker hands back after every step, to act mid-generation.
        self._waiting += 1
        try:
            async with cond:
                try:
                    await asyncio.wait_for(cond.wait_for(reached), timeout_s)
                except TimeoutError:
                    raise EngineError(
                        f"request {request_id} did not reach {n_tokens} tokens within timeout_s={timeout_s}"
                    ) from None
                seq = self._running.get(request_id)
                return 0 if seq is None else seq.n_generated
        finally:
            self._waiting -= 1

    # ---------------------------------------------------------------- pause / resume

    async def pause(self, mode: PauseMode = "keep", clear_cache: bool = False) -> None:
        """Pause with vLLM's ``abort`` | ``wait`` | ``keep``; returns once the mode holds."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._check_open()
        async with self._locked() as cond:  # taking the lock waits for the step in progress to end
            self._paused = mode
            if mode == "abort":
                while self._queued:
                    seq = self._queued.popleft()
                    _resolve(seq, seq.result("abort"))
                for seq in list(self._running.values()):
                    self._finish(seq, "abort")
            cond.notify_all()
            if mode == "wait":
                try:
                    await asyncio.wait_for(
                        cond.wait_for(lambda: not self._running and not self._queued or self._closed),
                        self.config.pause_timeout_s,
                    )
                except TimeoutError:
                    raise EngineError(
                        f"pause('wait') did not drain {len(self._running)} running and {len(self._queued)} "
                        f"queued requests within pause_timeout_s={self.config.pause_timeout_s}"
                    ) from None
            if clear_cache:
                self._drop_kv()

    async def resume(self) -> None:
        """Frozen requests continue from the same token; queued ones are admitted."""
        self._check_open()
        async with self._locked() as cond:
            self._paused = None
            cond.notify_all()

    def _drop_kv(self) -> None:
        """Forget every KV cache; the running requests re-prefill prompt + generated on resume."""
        for seq in self._running.values():
            if not seq.needs_prefill:
                self._counters["reprefill_tokens"] += len(seq.tokens)
        self._runner.drop_kv()

    # ---------------------------------------------------------------- weights

    def param_meta(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, shape)`` of each parameter in ``named_parameters()`` order (tied ones once)."""
        return [(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the model in place, by HF name; only while paused."""
        async with self._locked():
            if self._paused is None:
                raise EngineError("load_weights needs a paused engine: call pause('keep') first")
            named = list(named_tensors)
            for name, tensor in named:
                param = self._params.get(name)
                if param is None:
                    raise KeyError(f"load_weights: the model has no parameter named {name!r}")
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, the model expects "
                                     f"{tuple(param.shape)}")
            self._runner.weights_changed()
            await asyncio.to_thread(self._copy_weights, named)

    def weight_views(self) -> dict[str, torch.Tensor]:
        """The live parameter storage by HF name (tied names share one tensor); only while paused
        (else `EngineError`). A weight receiver may write received bytes straight into them; they stay
        valid until ``resume()``, and ``finish_weight_update`` makes the new weights live."""
        if self._paused is None:
            raise EngineError("weight_views needs a paused engine: call pause('keep') first")
        self._runner.weights_changed()  # the caller may write into them
        return {name: p.detach() for name, p in self._params.items()}

    def lora_views(self, rank: int, scale: float, modules: list[str]) -> dict[str, torch.Tensor] | None:
        """LoRA adapters kept unmerged in the lean forward, ``<module>.lora_A/B`` -> live tensor; None without it."""
        self._runner.weights_changed()
        return None if self._runner.decoder is None else self._runner.decoder.attach_lora(rank, scale, modules)

    @torch.no_grad()
    def _copy_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            self._params[name].copy_(tensor)

    async def finish_weight_update(self, version: int) -> None:
        """Make the loaded weights live as ``version``: later tokens carry it."""
        async with self._locked():
            self._version = int(version)
            self._runner.weights_changed()

    # ---------------------------------------------------------------- stats

    def stats(self) -> dict[str, int]:
        """running, queued, requests (accepted so far), tokens_generated, kv_tokens, reprefill_tokens,
        prefill_tokens (prompt tokens computed), shared_prefill_tokens (taken from another's prefill), steps,
        version; session_live, session_blocks (kept turns now) and `sessions.COUNTERS`."""
        sessions = self._runner.sessions
        return dict(running=len(self._running), queued=len(self._queued),
                    kv_tokens=sum(seq.cached for seq in self._running.values()), version=self._version,
                    session_live=len(sessions), session_blocks=sessions.blocks, **self._counters, **sessions.counters)

    def kv_memory(self) -> dict[str, int]:
        """KV cache memory: ``bytes`` the block pools hold now and ``peak_bytes`` ever; ``used_bytes``
        in blocks held by requests now and ``peak_used_bytes`` ever; ``peak_tokens`` ever cached at
        once (a shared prompt counted once per request holding it); ``block_tokens``."""
        cache = self._runner.cache
        block = cache.block_bytes()
        return dict(bytes=cache.nbytes(), peak_bytes=cache.peak_bytes, used_bytes=cache.used_blocks * block,
                    peak_used_bytes=cache.peak_used_blocks * block, peak_tokens=self._runner.peak_tokens,
                    block_tokens=cache.block_tokens)

    # ---------------------------------------------------------------- scheduler

    def _has_work(self) -> bool:
        return self._closed or (self._paused not in ("keep", "abort") and bool(self._running or self._queued))

    async def _schedule(self) -> None:
        cond = self._cond
        wait_s, small = self.config.batch_wait_ms / 1e3, max(1, self.config.max_running // 4)
        gather = False  # requests just came to a small batch: wait `wait_s` (unlocked) for more first
        try:
            while True:
                if gather:
                    await asyncio.sleep(wait_s)
                async with cond:
                    await cond.wait_for(self._has_work)
                    if self._closed:
                        return
                    before = len(self._running)
                    self._admit()
                    if wait_s and not gather and before < len(self._running) < small:
                        gather = True
                        continue
                    gather = False
                    if self._running:
                        await self._step()
                    cond.notify_all()
        except Exception as exc:  # (not CancelledError: a BaseException)
            # Forwarded to every waiting caller; later calls re-raise it from _check_open.
            self._failure = exc
            self._fail_all(EngineError(f"the engine's scheduler failed: {exc!r}"))

    def _admit(self) -> None:
        while self._queued and len(self._running) < self.config.max_running:
            seq = self._queued.popleft()
            if not seq.future.done():  # a cancelled caller's request is dropped here
                self._running[seq.rid] = seq

    async def _step(self) -> None:
        """Run steps in the worker thread until one needs the event loop; finish those that ended."""
        for seq in [s for s in self._running.values() if s.future.done()]:
            del self._running[seq.rid]
        if not self._running:
            return
        ended = await asyncio.to_thread(self._runner.run_steps, list(self._running.values()), self._version,
                                        self.max_model_len, self._counters, lambda: self._waiting or self._closed)
        for seq, reason in ended:
            self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._running.pop(seq.rid, None)
        if seq.request.session_id is not None and reason in ("stop", "length"):
            self._runner.keep(seq, self._version)
        _resolve(seq, seq.result(reason))

    def _fail_all(self, error: BaseException) -> None:
        for seq in [*self._queued, *self._running.values()]:
            if not seq.future.done():
                seq.future.set_exception(error)
        self._queued.clear()
        self._running.clear()


def _resolve(seq: Sequence, result: GenerateResult) -> None:
    if not seq.future.done():
        seq.future.set_result(result)
