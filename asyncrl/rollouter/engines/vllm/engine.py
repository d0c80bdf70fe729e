"""`VLLMEngine`: the `RolloutEngine` interface over vLLM's ``AsyncLLM`` (GPU, or the CPU build; 0.33 and 0.32).

One engine replica = one ``AsyncLLM`` (its EngineCore and GPU workers run in processes
vLLM starts). What maps onto what:

- ``generate`` -> ``AsyncLLM.generate(TokensPrompt, SamplingParams, request_id)`` with
  ``output_kind=DELTA`` (each step's new tokens, so progress is visible to
  `VLLMEngine.wait_for_tokens`), ``logprobs=0`` (the sampled token's log-prob only),
  ``detokenize=False`` (no tokenizer is loaded), and stop ids = the request's plus the
  model's EOS, exactly as the built-in engine (``ignore_eos=True`` keeps vLLM from adding
  EOS ids of its own). The engine is built with
  ``logprobs_mode="processed_logprobs"``: ``log_softmax(logits / T)`` of the sampled token,
  greedy rows at ``T = 1``, which is the built-in engine's quantity (see
  ``asyncrl/rollouter/engines/builtin/sampling.py``) whenever ``top_k=0, top_p=1``; with top-k/top-p vLLM
  renormalises over the kept tokens and the built-in engine does not.
- Per-token versions come from vLLM itself: the EngineCore labels every output with its
  weight version and ``CompletionOutput.weight_versions`` gives ``[start, end)`` spans per
  label. `receive_weights` commits each update with ``weight_version=str(version)``, so a
  request frozen by ``pause(keep)`` across an update carries the old version before the
  pause and the new one after it. vLLM's initial label ``"default"`` reads as
  ``initial_version``.
- ``pause(mode, clear_cache)`` -> ``pause_generation(mode=..., clear_cache=...)``;
  ``resume()`` -> ``resume_generation()``; ``abort(ids)`` -> ``AsyncLLM.abort(ids)`` (the
  request's final output then has ``finish_reason="abort"`` and its partial tokens).
  Requests vLLM rejects while paused (``RetryableRequestError``) raise `EnginePausedError`.
- Weights arrive through vLLM's NCCL transfer engine, driven by
  `asyncrl.sync.vllm.VLLMWeightReceiver` (both halves of that protocol live in
  `asyncrl.sync.vllm`); this class commits them (`finish_weight_update`). A weight step that
  fails or runs out of time sets ``weights_broken``: the engine then refuses ``resume()`` and
  every later weight call (vLLM's worker may still be inside the step), so it never serves
  half-loaded weights; such an engine is rebuilt.
- Prefix cache: every prompt carries ``cache_salt`` = the weight version it will be
  prefilled with (a fresh salt per pause while paused), so a request after an update never
  reuses prompt KV computed with older weights (``prefix_cache_salt=False`` drops the salt).
- Sampling: vLLM refuses ``temperature > 2`` and raises ``0 < temperature < 0.01`` to 0.01,
  which would make the behaviour log-probs lie; such requests are refused here
  (`check_vllm_temperature`, also run by the launcher on ``--temperature``).
- ``close()`` aborts the requests still in flight (their callers get ``finish_reason="abort"``
  with the partial tokens), waits up to ``close_timeout_s`` for them to leave, then shuts
  vLLM down (``AsyncLLM.shutdown()`` alone can leave ``generate()`` callers waiting forever).

Leaves out: ``load_weights`` from local tensors (vLLM's model lives in another process;
weights arrive only over the transfer engine), LoRA, multimodal inputs, ``n > 1`` (each of a
group's responses is its own request, all sent to one replica, where vLLM's prefix cache serves
the shared prompt; `stats` counts the cached prompt tokens). ``vllm`` is imported only when an
engine is built, so this module imports on machines without it. It runs in CI on vLLM's CPU
build (0.32, `tests/integration/test_vllm_real.py`); the GPU path (NCCL transfer) has not run yet.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from asyncrl.rollouter.engines.base import (
    PAUSE_MODES,
    EngineClosedError,
    EngineError,
    EnginePausedError,
    PauseMode,
    engine_config,
)
from asyncrl.rollouter.engines.vllm.config import VLLMEngineConfig, model_eos_token_ids, sampling_kwargs
from asyncrl.sync.vllm_broadcast import checkpoint_param_meta
from asyncrl.types import GenerateRequest, GenerateResult

_VLLM_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def map_finish_reason(request_id: str, reason: str | None) -> str:
    """vLLM's finish reason -> asyncrl's (stop | length | abort); anything else is an EngineError."""
    if (ours := _VLLM_FINISH.get(reason)) is None:
        raise EngineError(f"request {request_id}: vLLM finished it with {reason!r}, not stop/length/abort")
    return ours


def sampled_logprobs(request_id: str, token_ids: Sequence[int], logprobs) -> np.ndarray:
    """Log-prob of each sampled token from vLLM's per-position logprobs.

    ``logprobs`` is vLLM's ``SampleLogprobs``: a list of ``{token_id: Logprob}`` per position
    (or a ``FlatLogprobs``, indexable the same way).
    """
    if logprobs is None:
        if len(token_ids) == 0:
            return np.zeros(0, dtype=np.float32)
        raise EngineError(f"request {request_id}: vLLM returned no logprobs (was logprobs=0 dropped?)")
    if len(logprobs) != len(token_ids):
        raise EngineError(f"request {request_id}: {len(token_ids)} tokens but {len(logprobs)} logprob positions")
    out = np.empty(len(token_ids), dtype=np.float32)
    for i, tok in enumerate(token_ids):
        entry = logprobs[i].get(int(tok))
        if entry is None:
            raise EngineError(f"request {request_id}: no logprob for sampled token {tok} at position {i}")
        out[i] = entry.logprob
    return out


def expand_version_spans(spans, num_tokens: int, initial_version: int) -> np.ndarray:
    """Per-token versions from vLLM's ``weight_versions`` spans (``.version``, ``.start``, ``.end``).

    Labels are ``str(version)``; vLLM's unset label ``"default"`` reads as ``initial_version``.
    Spans must tile ``[0, num_tokens)``.
    """
    versions = np.full(num_tokens, -1, dtype=np.int64)
    if not spans:
        if num_tokens:
            raise EngineError(f"vLLM returned {num_tokens} tokens without weight-version spans")
        return versions
    for span in spans:
        if (label := span.version) == "default":
            v = initial_version
        else:
            try:
                v = int(label)
            except ValueError:
                raise EngineError(f"weight version label {label!r} is not an integer version") from None
        versions[span.start : span.end] = v
    if num_tokens and (versions < 0).any():
        raise EngineError(f"weight-version spans {[(s.start, s.end) for s in spans]} do not cover {num_tokens} tokens")
    return versions


def _counting_stat_logger(counts: dict):
    """A vLLM stat-logger factory that adds what vLLM reports per engine step into ``counts``
    (``AsyncLLM(stat_loggers=[...])``; vLLM calls it in this process)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class CountingStatLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                counts["running"] = scheduler_stats.num_running_reqs
                counts["queued"] = scheduler_stats.num_waiting_reqs
            if iteration_stats is not None:
                counts["preempted"] += iteration_stats.num_preempted_reqs
                counts["prompt_tokens_computed"] += iteration_stats.prompt_token_stats.computed
                counts["prompt_tokens_cached"] += iteration_stats.prompt_token_stats.cached_tokens

        def log_engine_initialized(self) -> None:
            pass

    return CountingStatLogger


class VLLMEngine:
    """One vLLM replica behind the `RolloutEngine` interface (see the module docstring).

    ``VLLMEngine(model_path, **fields)`` or ``VLLMEngine(config=VLLMEngineConfig(...))``, as
    `TorchEngine`. Building it starts vLLM's EngineCore and loads the model (blocking).
    """

    def __init__(self, model_path: str | Path | None = None, *, config: VLLMEngineConfig | None = None, **kwargs):
        self.config = config = engine_config(VLLMEngineConfig, model_path, config, kwargs)
        self._eos = config.eos_token_ids if config.eos_token_ids is not None else model_eos_token_ids(config.model_path)
        # vLLM logs a line per weight load at INFO, from every worker; its warnings and errors are
        # what a run's console needs (VLLM_LOGGING_LEVEL set by the user wins; vLLM's processes
        # started below inherit it)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from vllm.platforms import current_platform

        self._counters = dict(tokens_generated=0, requests=0, running=0, queued=0, preempted=0,
                              prompt_tokens_computed=0, prompt_tokens_cached=0)
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**config.engine_args(cpu=current_platform.is_cpu())),
                                             stat_loggers=[_counting_stat_logger(self._counters)])
        """vLLM's engine (`asyncrl.sync.vllm.VLLMWeightReceiver` drives its weight transfer)."""
        self._version = config.initial_version
        self._paused: PauseMode | None = None
        self._pauses = 0
        self.weight_update_open = False
        """True between a started weight update and its `finish_weight_update`."""
        self.weights_broken: str | None = None
        """Why the weights may be half loaded (a weight step failed or timed out); None when whole."""
        self._closed = False
        self._live: dict[str, list[int]] = {}  # request id -> tokens so far (one-element list)
        self._left = asyncio.Event()  # set whenever _live becomes empty
        self._waiters: dict[str, list[tuple[int, asyncio.Future]]] = {}

    @property
    def version(self) -> int:
        return self._version

    @property
    def paused(self) -> PauseMode | None:
        """The pause mode in force, or None while serving."""
        return self._paused

    def weight_dtype(self) -> str:
        """The dtype vLLM holds the weights in (what the weight sync sends by default)."""
        return str(self.llm.model_config.dtype).removeprefix("torch.")

    def _cache_salt(self) -> str:
        # The prompt is prefilled with the weights of the version after the current pause, which
        # is unknown while paused: a salt of its own per pause never matches KV of older weights.
        if self._paused is None:
            return f"asyncrl-v{self._version}"
        return f"asyncrl-v{self._version}-pause{self._pauses}"

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Generate one response; waits (queued in vLLM) while the engine is paused with ``keep``."""
        from vllm import SamplingParams
        from vllm.exceptions import RetryableRequestError
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        rid = request.request_id
        self.check_open()
        if self._paused in ("abort", "wait"):
            raise EnginePausedError(
                f"request {rid} refused: the engine is paused with mode={self._paused!r}; call resume() first"
            )
        if rid in self._live:
            raise ValueError(f"request_id {rid!r} is already in flight")
        # DELTA outputs: each step's new tokens, so progress is visible (wait_for_tokens).
        params = SamplingParams(**sampling_kwargs(request, self._eos), output_kind=RequestOutputKind.DELTA)
        prompt = {"prompt_token_ids": request.prompt_ids.tolist()}
        if self.config.prefix_cache_salt:
            prompt["cache_salt"] = self._cache_salt()
        ids: list[int] = []
        logps: list[np.ndarray] = []
        final = None
        self._live[rid] = [0]
        self._left.clear()
        try:
            async for out in self.llm.generate(prompt, params, rid):
                completion = out.outputs[0]
                new = list(completion.token_ids)
                ids += new
                logps.append(sampled_logprobs(rid, new, completion.logprobs))
                self._progress(rid, len(ids))
                final = completion
        except RetryableRequestError as exc:
            raise EnginePausedError(f"request {rid} refused by vLLM while paused: {exc}") from exc
        except EngineDeadError as exc:
            raise EngineClosedError(f"request {rid}: the vLLM engine died or was closed") from exc
        finally:
            self._live.pop(rid, None)
            if not self._live:
                self._left.set()
            self._progress(rid, 0, done=True)
        if final is None or final.finish_reason is None:
            raise EngineError(f"request {rid}: vLLM ended the request without a final output")
        self._counters["tokens_generated"] += len(ids)
        self._counters["requests"] += 1
        return GenerateResult(
            request_id=rid,
            response_ids=np.asarray(ids, dtype=np.int64),
            logprobs=np.concatenate(logps) if logps else np.zeros(0, dtype=np.float32),
            versions=expand_version_spans(final.weight_versions, len(ids), self.config.initial_version),
            finish_reason=map_finish_reason(rid, final.finish_reason),
        )

    def _progress(self, rid: str, n: int, done: bool = False) -> None:
        if not done:
            self._live[rid][0] = n
        waiting = self._waiters.get(rid, [])
        keep = []
        for target, fut in waiting:
            if fut.done():
                continue
            if done or n >= target:
                fut.set_result(0 if done else n)
            else:
                keep.append((target, fut))
        if keep:
            self._waiters[rid] = keep
        else:
            self._waiters.pop(rid, None)

    def progress(self, request_ids: Iterable[str]) -> dict[str, int]:
        """Tokens each named request in flight has streamed back so far (0 while vLLM still
        queues or prefills it); ids not in flight are left out."""
        return {rid: self._live[rid][0] for rid in request_ids if rid in self._live}

    async def wait_for_tokens(self, request_id: str, n_tokens: int, timeout_s: float = 60.0) -> int:
        """Wait until ``request_id`` has ``n_tokens`` or has left; its count then (0 once left).

        Same hook as `TorchEngine.wait_for_tokens`; an unknown id returns 0 at once. Raises
        `EngineError` naming ``timeout_s`` when it runs out.
        """
        live = self._live.get(request_id)
        if live is None:
            return 0
        if live[0] >= n_tokens:
            return live[0]
        fut = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(request_id, []).append((n_tokens, fut))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise EngineError(
                f"request {request_id} did not reach {n_tokens} tokens within timeout_s={timeout_s}"
            ) from None

    async def pause(self, mode: PauseMode = "keep", clear_cache: bool = False) -> None:
        """vLLM's ``pause_generation(mode=..., clear_cache=...)``; returns once the mode holds."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.check_open()
        self._paused = mode  # first, so a generate() racing the pause is refused here too
        self._pauses += 1
        await self.llm.pause_generation(mode=mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        """vLLM's ``resume_generation()``; refused while a weight update is open or failed."""
        self.check_open()
        if self.weights_broken is not None:
            raise EngineError(f"refusing to resume on partly loaded weights: {self.weights_broken}")
        if self.weight_update_open:
            raise EngineError("resume() during a weight update: call finish_weight_update(version) first")
        await self.llm.resume_generation()
        self._paused = None

    async def end_session(self, session_id: str) -> None:
        """Nothing to drop: the prefix cache (salted per version) serves a session's next turn."""

    async def abort(self, request_ids: Iterable[str]) -> None:
        """End the named requests now with their partial output; unknown ids are ignored."""
        ids = [r for r in request_ids if r in self._live]
        if ids and not self._closed:  # a closed engine ended its requests already
            await self.llm.abort(ids)

    def param_meta(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """Checkpoint-format ``(name, dtype, shape)`` of the model directory (`checkpoint_param_meta`).

        These names are what vLLM's ``load_weights`` maps (fused qkv etc. happen inside
        vLLM), i.e. what the trainer sends; vLLM casts received tensors to its own dtype.
        """
        return checkpoint_param_meta(self.config.model_path)

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError(
            "VLLMEngine's model lives in vLLM's worker processes: weights reach it over a weight-sync group "
            "(WeightSyncConfig(method='broadcast'): asyncrl.sync.vllm_broadcast; method='vllm': vLLM's NCCL engine)"
        )

    async def finish_weight_update(self, version: int) -> None:
        """Commit what vLLM's transfer engine received as ``version`` (``method="vllm"``)."""
        self.check_open()
        if not self.weight_update_open:
            raise EngineError("finish_weight_update without a started weight update: nothing to commit")
        await self.llm.finish_weight_update()
        await self.commit_version(version)

    async def commit_version(self, version: int) -> None:
        """Label the weights now loaded in every worker as ``version`` in vLLM's EngineCore: tokens
        generated after resume carry it in ``weight_versions``."""
        self.check_open()
        await self.llm.update_weight_version(str(version))
        self.weight_update_open = False
        self.weights_broken = None
        self._version = int(version)

    def stats(self) -> dict[str, int]:
        """Counters: tokens_generated, requests (finished), version, and from vLLM's scheduler and iteration
        stats (`_counting_stat_logger`): running, queued, preempted (requests vLLM preempted and
        so re-prefills: 0 through a ``pause(keep)`` with ``clear_cache=False``),
        prompt_tokens_computed and prompt_tokens_cached (prompt tokens served from the prefix
        cache). vLLM keeps its KV token count inside the EngineCore; it is not reported."""
        return dict(version=self._version, **self._counters)

    async def close(self) -> None:
        """Abort the requests in flight (their callers get their partial output with
        ``finish_reason="abort"``), wait up to ``close_timeout_s`` for them to leave, shut vLLM down."""
        if self._closed:
            return
        self._closed = True
        live = list(self._live)
        if live:
            try:
                await asyncio.wait_for(self._abort_and_drain(live), self.config.close_timeout_s)
            except TimeoutError:
                pass  # shut down anyway; callers still waiting then get EngineClosedError from vLLM
        llm, self.llm = self.llm, None
        llm.shutdown()
        # vLLM's AsyncLLM shuts down again in __del__; let that happen now, not at interpreter exit,
        # when the module globals it calls are already gone (a TypeError printed at every exit)
        del llm

    async def _abort_and_drain(self, ids: list[str]) -> None:
        await self.llm.abort(ids)
        await self._left.wait()

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        """Raise `EngineClosedError` once `close` was called."""
        if self._closed:
            raise EngineClosedError("the vLLM engine is closed")
