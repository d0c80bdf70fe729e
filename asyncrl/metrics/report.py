"""What the running system reports: small wrappers and functions that turn its state into metrics.

The wiring stays a few calls long: the launcher wraps the Trainer's group source in
`MeteredSource` and emits `trainer_step_metrics` after each step; the Rollouter process runs
`report_rollouter` beside the Rollouter (its idle ratio is the Rollouter's own clock of engine
calls in flight). Names are
in `asyncrl.metrics.names`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.calls import call

log = logging.getLogger("asyncrl.metrics")

STALENESS_BUCKETS = 9  # 0..7 and "8 or more"
AGE_BUCKETS = 5  # 0..3 and "4 or more"


# ----------------------------------------------------------------------------- Rollouter side

ENGINE_COUNTERS = ("groups", "group_prompt_tokens", "group_prefill_tokens", "prompt_tokens_computed",
                   "prompt_tokens_cached")
"""Engine counters (summed over replicas) behind the shared-prefill metrics (`prefill_metrics`)."""


SESSION_KEYS = ("session_live", "session_blocks", "session_kept", "session_hits", "session_tokens_reused",
                "session_misses", "session_evicted", "session_dropped")
"""The built-in engine's conversation counters (`asyncrl.rollouter.engines.builtin.sessions`), summed
over the replicas as ``engine/{key}``."""


def engine_counters(stats: list[dict]) -> dict[str, int]:
    """`ENGINE_COUNTERS` summed over the replicas' ``stats()`` (`EngineActor.stats`)."""
    return {k: sum(int(s.get(k, 0)) for s in stats) for k in ENGINE_COUNTERS}


def prefill_metrics(last: dict, now: dict) -> dict[str, float]:
    """Shared prefill between two `engine_counters` readings: the means over the group calls that
    ended in between of the prompt tokens prefilled for them and of the distinct prompt tokens they
    carried (equal when each group's prompt is prefilled once), and vLLM's prefix-cache hit rate."""
    d = {k: now.get(k, 0) - last.get(k, 0) for k in ENGINE_COUNTERS}
    out: dict[str, float] = {}
    if d["groups"] > 0:
        out["engine/prefill_tokens_per_group"] = d["group_prefill_tokens"] / d["groups"]
        out["engine/prompt_tokens_per_group"] = d["group_prompt_tokens"] / d["groups"]
    seen = d["prompt_tokens_computed"] + d["prompt_tokens_cached"]
    if seen > 0:
        out["engine/prefix_cache_hit_rate"] = d["prompt_tokens_cached"] / seen
    return out


class RolloutReporter:
    """Turns the Rollouter process's state into one dict of metrics per poll."""

    def __init__(self, engines: list, n: int):
        self.engines, self.n = engines, n
        self._last_tokens: int | None = None
        self._last_t = time.monotonic()
        self._last_idle = 0.0  # the Rollouter's idle clock starts with it, about when this reporter does
        self._last_counters: dict = {}

    async def poll(self, rollouter: Any, producer: Any) -> dict[str, float]:
        stats = await asyncio.gather(*(call(e, "stats") for e in self.engines))
        now, last_t = time.monotonic(), self._last_t
        counters = engine_counters(stats)
        out: dict[str, float] = prefill_metrics(self._last_counters, counters)
        self._last_counters = counters
        for i, s in enumerate(stats):
            for key in ("running", "queued", "kv_tokens", "requests", "tokens_generated"):
                out[f"engine/{i}/{key}"] = s.get(key, 0)
        for key in ("running", "queued", "kv_tokens", "reprefill_tokens", "preempted", *SESSION_KEYS):
            out[f"engine/{key}"] = sum(s.get(key, 0) for s in stats)
        tokens = sum(s.get("tokens_generated", 0) for s in stats)
        if self._last_tokens is not None and now > self._last_t:
            out["throughput/generated_tokens_per_s"] = (tokens - self._last_tokens) / (now - self._last_t)
        self._last_tokens, self._last_t = tokens, now
        if rollouter is not None:
            rs = rollouter.stats_now()
            if now > last_t:  # the Rollouter's own clock of calls in flight (from the first poll on)
                out["fully_async/rollouter/idle_ratio"] = min(1.0, max(0.0, rs["idle_s"] - self._last_idle) / (now - last_t))
            self._last_idle = rs["idle_s"]
            out["engine/requests_spread"] = rs["requests_spread"]
            out.update({
                "fully_async/count/total_generated_samples": rollouter.sent * self.n,
                "rollouter/admitted": rollouter.admitted,
                "rollouter/in_flight": rollouter.admitted - rollouter.sent,
                "rollouter/failed_groups": rollouter.failed,
                "rollouter/filtered_groups": rs["filter_dropped"],
                "rollouter/version": rollouter.version,
            })
            # An EnvLoop's totals (its `counts`, as ``agent_{name}`` in the Rollouter's stats).
            out.update({f"agent/{k.removeprefix('agent_')}": v for k, v in rs.items() if k.startswith("agent_")})
        if producer is not None:
            out["stream/credit"] = producer.credit
            out["stream/unacked"] = len(producer.unacked)  # a property of StreamProducer
        return out


async def report_rollouter(emitter: Any, reporter: RolloutReporter, get_parts, interval_s: float) -> None:
    """Emit ``reporter.poll(*get_parts())`` now and every ``interval_s`` until cancelled.

    A poll that fails (an engine died) is logged once and skipped: metrics never stop the run.
    """
    failures = 0
    while True:
        try:
            rollouter, producer = get_parts()
            values = await reporter.poll(rollouter, producer)
            emitter.emit_many(values, version=int(values.get("rollouter/version", -1)))
        except Exception as e:
            if not failures:
                log.warning("metrics: the Rollouter's report failed (%s: %s); later failures are not logged",
                            type(e).__name__, e)
            failures += 1
        await asyncio.sleep(interval_s)  # a periodic report, not a wait on a condition


# ----------------------------------------------------------------------------- Trainer side

@dataclass
class _Sample:
    length: int
    truncated: bool
    age: int
    oldest: int
    span: int


@dataclass
class StepSamples:
    """What the groups of one step looked like, and how long the step waited for them."""

    wait_s: float = 0.0
    samples: list[_Sample] = field(default_factory=list)


class MeteredSource:
    """A group source (the stream's consumer) that times ``recv`` and notes each group's shape."""

    def __init__(self, source: Any):
        self._source = source
        self._wait_s = 0.0
        self._seen: dict[str, list[_Sample]] = {}

    async def recv(self, timeout: float | None = None):
        t0 = time.perf_counter()
        try:
            group = await self._source.recv(timeout=timeout)
        finally:
            self._wait_s += time.perf_counter() - t0
        # Model tokens' versions only: an agent loop's observation tokens carry -1 (no policy wrote them).
        self._seen[group.sample_id] = [
            _Sample(length=len(t.response_ids), truncated=t.finish_reason == "length", age=int(t.age),
                    oldest=int(v.min()) if len(v) else -1, span=int(v.max() - v.min()) if len(v) else 0)
            for t in group.trajectories for v in (t.model_versions,)
        ]
        return group

    def ack(self, sample_ids, reason: str | None = None) -> None:
        self._source.ack(sample_ids, reason=reason)

    def take(self, sample_ids) -> StepSamples:
        """The samples of ``sample_ids`` (the step's trained groups) and the wait so far; resets."""
        out = StepSamples(wait_s=self._wait_s)
        for sid in sample_ids:
            out.samples.extend(self._seen.get(sid, ()))
        self._seen.clear()
        self._wait_s = 0.0
        return out

    def __getattr__(self, name: str):
        return getattr(self._source, name)


_RENAMED = {
    "staleness_mean": "staleness/mean", "staleness_max": "staleness/max",
    "response_length_mean": "response_length/mean", "response_length_max": "response_length/max",
}


@dataclass
class TrainerTotals:
    """Counts the Trainer side carries from step to step."""

    stale_samples: int = 0
    dropped_stale: int = 0


def trainer_step_metrics(metrics: dict, samples: StepSamples, *, trained_version: int, step_s: float,
                         totals: TrainerTotals, sync: Any = None, consumer: Any = None) -> dict[str, float]:
    """One step's events: the Trainer's own ``metrics`` renamed, plus what async RL adds.

    ``trained_version`` is the version the step trained on (before its sync); ``sync`` the
    coordinator's report when the step ended with a weight sync.
    """
    # Names with a "/" (val/...) are already names; the launcher's time_s/tokens_per_s have better ones here.
    out = {_RENAMED.get(k, k if "/" in k else f"train/{k}"): v for k, v in metrics.items()
           if k not in ("version", "time_s", "tokens_per_s")}
    s = samples.samples
    lengths = np.array([x.length for x in s], dtype=np.float64)
    version = metrics.get("version", trained_version)
    wait_s = metrics.get("timing_s/wait_data", samples.wait_s)  # the Trainer's own, when it gives one
    out.update({
        "fully_async/trainer/idle_ratio": min(1.0, wait_s / step_s) if step_s > 0 else 0.0,
        "timing_s/step": step_s,
        "timing_s/wait_data": wait_s,
        "fully_async/count/current_param_version": version,
    })
    totals.dropped_stale += int(metrics.get("dropped_stale", 0))
    out["fully_async/count/dropped_stale_samples"] = totals.dropped_stale
    if sync is not None:
        out.update({"timing_s/param_sync": sync.total_s, "timing_s/param_sync_pause": sync.pause_s,
                    "timing_s/param_sync_transfer": sync.transfer_s, "timing_s/param_sync_resume": sync.resume_s})
    if consumer is not None:
        out.update({"stream/depth": consumer.depth, "stream/received": consumer.stats.received,
                    "stream/acked": consumer.stats.acked, "stream/committed_kept": consumer.committed.exceptions})
    if not s:
        return out
    out["throughput/trained_tokens_per_s"] = float(lengths.sum()) / step_s if step_s > 0 else 0.0
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    truncated = sum(x.truncated for x in s)
    out.update({"response_length/p50": p50, "response_length/p90": p90, "response_length/p99": p99,
                "response_length/truncated": truncated, "response_length/truncated_ratio": truncated / len(s)})
    gaps = [trained_version - x.oldest for x in s if x.oldest >= 0]
    totals.stale_samples += sum(g > 0 for g in gaps)
    out["fully_async/count/stale_samples_processed"] = totals.stale_samples
    hist = np.bincount(np.clip(gaps, 0, STALENESS_BUCKETS - 1), minlength=STALENESS_BUCKETS) if gaps else \
        np.zeros(STALENESS_BUCKETS, dtype=np.int64)
    out.update({f"staleness/hist/{k}": int(c) for k, c in enumerate(hist)})
    ages = np.array([x.age for x in s])
    partial = int((ages > 0).sum())
    out.update({
        "fully_async/partial/total_partial_num": partial,
        "fully_async/partial/partial_ratio": partial / len(s),
        "fully_async/partial/max_partial_span": max(x.span for x in s),
        "fully_async/partial/age_mean": float(ages.mean()),
    })
    age_hist = np.bincount(np.clip(ages, 0, AGE_BUCKETS - 1), minlength=AGE_BUCKETS)
    out.update({f"fully_async/partial/age_hist/{k}": int(c) for k, c in enumerate(age_hist)})
    return out


class TrainerReporter:
    """The launcher's per-step report: call `after_step` with each step's result."""

    def __init__(self, emitter: Any, source: MeteredSource, coordinator: Any = None, consumer: Any = None):
        self.emitter, self.source, self.coordinator, self.consumer = emitter, source, coordinator, consumer
        self.totals = TrainerTotals()
        self._last_sync = getattr(coordinator, "last", None)
        self._version = 0
        self._t = time.perf_counter()

    def after_step(self, result: Any) -> None:
        now = time.perf_counter()
        sync = getattr(self.coordinator, "last", None)
        # The launcher's step time (asyncrl.progress.train) when it gives one, so the stream and
        # metrics.jsonl agree; else the time since the last report.
        step_s = result.metrics.get("timing_s/step", now - self._t)
        values = trainer_step_metrics(
            result.metrics, self.source.take(result.sample_ids), trained_version=self._version,
            step_s=step_s, totals=self.totals, sync=sync if sync is not self._last_sync else None,
            consumer=self.consumer)
        if self.coordinator is not None:
            values["fault/engine_restarts"] = getattr(self.coordinator, "joined", 0)
        self.emitter.emit_many(values, step=result.step, version=result.version)
        self._last_sync, self._version, self._t = sync, result.version, now
