"""The metric stream and its sinks, in-process with real ZeroMQ sockets, files and HTTP."""

from __future__ import annotations

import json
import time
import urllib.request

import msgpack
import numpy as np
import pytest
import zmq

from asyncrl.metrics.config import MetricsConfig
from asyncrl.metrics.events import MetricEvent, MetricsWireError, decode, encode
from asyncrl.metrics.names import NAMES, is_known, markdown_table
from asyncrl.metrics.report import MeteredSource, TrainerReporter, TrainerTotals, trainer_step_metrics
from asyncrl.metrics.service import MetricsService
from asyncrl.metrics.sinks import SinkSet, open_sinks
from asyncrl.metrics.sinks.jsonl import read_events
from asyncrl.metrics.stream import MetricsEmitter, MetricsEndpoints, MetricsForwarder, MetricsSubscriber
from asyncrl.net import free_port
from asyncrl.types import Group, Trajectory


def _collect(sub: MetricsSubscriber, n: int, timeout_s: float = 10.0) -> list[MetricEvent]:
    """The next ``n`` events (a malformed message gives none and is skipped), with a deadline."""
    out: list[MetricEvent] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(out)} of {n} events within {timeout_s}s")
        out.extend(sub.recv(timeout_s=0.5))
    return out


# ------------------------------------------------------------------------------ schema

def test_event_round_trip_keeps_every_field():
    events = [MetricEvent("train/loss", -0.25, step=3, version=2, time=1700000000.5, source="trainer"),
              MetricEvent("engine/0/running", 7.0, step=-1, version=2, time=1700000001.0, source="trainer")]
    source, seq, back = decode(encode("trainer", 41, events))
    assert (source, seq, back) == ("trainer", 41, events)
    assert [MetricEvent.from_json(json.loads(json.dumps(e.to_json()))) for e in events] == events


def test_decode_names_what_is_malformed():
    with pytest.raises(MetricsWireError, match="not msgpack"):
        decode(b"\xc1")
    with pytest.raises(MetricsWireError, match="v=1"):
        decode(msgpack.packb({"v": 9, "source": "x", "seq": 0, "events": []}))
    with pytest.raises(MetricsWireError, match="bad event"):
        decode(msgpack.packb({"v": 1, "source": "x", "seq": 0, "events": [["a", 1.0]]}))
    with pytest.raises(MetricsWireError, match="not a metric event"):
        MetricEvent.from_json({"value": 1})


def test_config_checks_name_the_field():
    assert MetricsConfig(sinks=["console"]).sinks == ["jsonl", "console"]
    with pytest.raises(ValueError, match=r"MetricsConfig.sinks has unknown sink\(s\) \[.graphite.\]"):
        MetricsConfig(sinks=("graphite",))
    with pytest.raises(ValueError, match="MetricsConfig.poll_interval_s"):
        MetricsConfig(poll_interval_s=0)


def test_names_table_covers_placeholders():
    assert is_known("engine/3/running") and is_known("staleness/hist/8") and is_known("timing_s/param_sync")
    assert not is_known("engine/x/running") and not is_known("train/nonsense")
    assert markdown_table().count("\n") == len(NAMES) + 1


# ------------------------------------------------------------------------------ stream

def test_stream_carries_events_from_several_publishers():
    with MetricsForwarder() as fwd:
        sub = MetricsSubscriber(fwd.endpoints.subscribe)
        a = MetricsEmitter(fwd.endpoints.publish, "trainer")
        b = MetricsEmitter(fwd.endpoints.publish, "rollouter")
        assert a.ready and b.ready  # the subscription reached both before their first event
        try:
            a.emit_many({"train/loss": 0.5, "train/grad_norm": float("nan")}, step=1, version=0)
            b.emit("engine/running", 4, version=0)
            got = _collect(sub, 2)
            assert {(e.source, e.name, e.value, e.step) for e in got} == {
                ("trainer", "train/loss", 0.5, 1), ("rollouter", "engine/running", 4.0, -1)}
            assert a.skipped == 1  # NaN is left out, not sent
            assert sub.dropped == {} and sub.received == 2
        finally:
            a.close(), b.close(), sub.close()


def test_slow_subscriber_never_blocks_the_publisher_and_counts_its_drops():
    n = 5000
    with MetricsForwarder(recv_hwm=10) as fwd:
        slow = MetricsSubscriber(fwd.endpoints.subscribe, recv_hwm=10)
        emitter = MetricsEmitter(fwd.endpoints.publish, "trainer", send_hwm=10)
        try:
            for step in range(n):  # never waits: a full queue drops (NOBLOCK) instead
                emitter.emit_many({"train/loss": float(step), "pad": float(step)}, step=step)
            assert emitter.sent + emitter.dropped == n
            # The subscriber read nothing while all that was sent; now it drains what was kept.
            received = []
            while got := slow.recv(timeout_s=1.0):
                received.append(got[0].step)
            assert received == sorted(received) and len(received) < n
            # Every message is accounted for: received, or counted as dropped (at the publisher or
            # the forwarder), except a tail lost after the last one received (no later seq shows it).
            assert len(received) + slow.dropped["trainer"] == received[-1] + 1
            assert slow.dropped["trainer"] > 0
        finally:
            emitter.close(), slow.close()


def test_subscriber_counts_gaps_and_survives_garbage():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = MetricsSubscriber(f"tcp://127.0.0.1:{port}")
    try:
        probe = encode("r", 0, [MetricEvent("x", 1.0)])
        while not sub.recv(timeout_s=0.05):  # slow joiner: send until the subscription is in place
            pub.send(probe)
        while sub.recv(timeout_s=0.2):
            pass
        for seq in (1, 4, 5):
            pub.send(encode("r", seq, [MetricEvent("x", float(seq))]))
        pub.send(b"garbage")
        pub.send(encode("r", 0, [MetricEvent("x", 0.0)]))  # a restarted source numbers from 0 again
        pub.send(encode("r", 1, [MetricEvent("x", 1.0)]))
        got = [e.value for e in _collect(sub, 5)]
        assert got == [1.0, 4.0, 5.0, 0.0, 1.0]
        assert sub.dropped == {"r": 2} and sub.malformed == 1
    finally:
        sub.close()
        pub.close(linger=0)


# ------------------------------------------------------------------------------ sinks

def _events(step: int) -> list[MetricEvent]:
    return [MetricEvent("train/reward_mean", 0.1 * step, step, step, 1700000000.0 + step, "trainer"),
            MetricEvent("fully_async/trainer/idle_ratio", 0.5, step, step, 1700000000.0 + step, "trainer"),
            MetricEvent("engine/0/running", 3.0 + step, -1, step, 1700000000.2 + step, "rollouter")]


def test_jsonl_sink_writes_one_event_per_line(tmp_path):
    sinks = open_sinks(MetricsConfig(sinks=()), tmp_path)
    for step in (1, 2):
        sinks.write(_events(step))
    sinks.close()
    assert read_events(tmp_path / "events.jsonl") == _events(1) + _events(2)
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"name": "torn')  # a run killed mid-line
    assert len(read_events(tmp_path / "events.jsonl")) == 6


def test_tensorboard_sink_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sinks = open_sinks(MetricsConfig(sinks=("tensorboard",)), tmp_path)
    assert sinks.failed == {}
    for step in (1, 2, 3):
        sinks.write(_events(step))
    sinks.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    reward = acc.Scalars("train/reward_mean")
    assert [(s.step, round(s.value, 6)) for s in reward] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    # An event without a step is logged at the latest trainer step seen.
    assert [(s.step, s.value) for s in acc.Scalars("engine/0/running")] == [(1, 4.0), (2, 5.0), (3, 6.0)]
    assert reward[0].wall_time == pytest.approx(1700000001.0)


def test_prometheus_sink_serves_parsable_text(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    sinks = open_sinks(MetricsConfig(sinks=("prometheus",), prometheus_port=0), tmp_path)
    assert sinks.failed == {}
    prom = next(s for s in sinks.sinks if s.name == "prometheus")
    try:
        sinks.write(_events(1))
        sinks.write(_events(2))
        text = urllib.request.urlopen(prom.url, timeout=10).read().decode()
    finally:
        sinks.close()
    samples = {(s.name, s.labels.get("source")): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("asyncrl_train_reward_mean", "trainer")] == pytest.approx(0.2)
    assert samples[("asyncrl_fully_async_trainer_idle_ratio", "trainer")] == 0.5
    assert samples[("asyncrl_engine_0_running", "rollouter")] == 5.0


def test_a_sink_that_cannot_open_or_write_is_reported_once_and_the_rest_go_on(tmp_path, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sinks = open_sinks(MetricsConfig(sinks=("prometheus", "wandb"), prometheus_port=port), tmp_path)
    assert set(sinks.failed) >= {"prometheus"}
    assert [s.name for s in sinks.sinks] == ["jsonl"] + (["wandb"] if "wandb" not in sinks.failed else [])

    class DiskFull:
        name = "disk"
        writes = 0

        def write(self, events):
            DiskFull.writes += 1
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    guarded = SinkSet([DiskFull(), *sinks.sinks])
    for step in (1, 2, 3):
        guarded.write(_events(step))
    guarded.close()
    assert DiskFull.writes == 1 and "No space left" in guarded.failed["disk"]
    err = capsys.readouterr().err
    assert err.count("'disk' is off") == 1 and err.count("'prometheus' is off") == 1
    assert len(read_events(tmp_path / "events.jsonl")) == 9  # the JSONL sink got every step


def test_service_records_what_emitters_publish(tmp_path):
    svc = MetricsService(MetricsConfig(sinks=()), tmp_path)
    try:
        assert MetricsEndpoints.read(tmp_path) == svc.endpoints
        em = svc.emitter("trainer")
        for step in range(1, 51):
            em.emit_many({"train/reward_mean": step / 100, "train/loss": 0.0}, step=step)
        assert svc.wait_recorded(em, timeout_s=10)
        em.close()
    finally:
        svc.close()
    events = read_events(tmp_path / "events.jsonl")
    assert [e.step for e in events if e.name == "train/reward_mean"] == list(range(1, 51))


# ------------------------------------------------------------------------------ the system's reports

class _Source:
    def __init__(self, groups):
        self.groups = list(groups)
        self.acks = []

    async def recv(self, timeout=None):
        return self.groups.pop(0)

    def ack(self, ids, reason=None):
        self.acks.append((list(ids), reason))


def _group(sid: str, lengths: list[int], versions: list[int], ages: list[int]) -> Group:
    trajs = [Trajectory(sample_id=sid, index=k, prompt_ids=np.array([1, 2]), response_ids=np.arange(n),
                        logprobs=np.zeros(n, dtype=np.float32), versions=np.full(n, v),
                        finish_reason="length" if n == 6 else "stop", reward=1.0, age=a)
             for k, (n, v, a) in enumerate(zip(lengths, versions, ages))]
    return Group(sample_id=sid, trajectories=trajs, expected=len(trajs))


async def test_step_report_from_the_groups_trained():
    src = MeteredSource(_Source([_group("sample_0_0", [2, 6], [3, 3], [0, 1]),
                                 _group("sample_0_1", [4, 6], [1, 2], [0, 2]),
                                 _group("sample_0_2", [1, 1], [0, 0], [0, 0])]))
    for _ in range(3):
        await src.recv(timeout=1)
    src.ack(["sample_0_0"])
    assert src.acks == [(["sample_0_0"], None)]
    totals = TrainerTotals()
    out = trainer_step_metrics({"loss": 0.1, "reward_mean": 1.0, "staleness_mean": 0.5, "step": 4, "version": 3,
                                "dropped_stale": 1.0},
                               src.take(["sample_0_0", "sample_0_1"]),  # sample_0_2 was not trained
                               trained_version=3, step_s=2.0, totals=totals)
    assert out["train/loss"] == 0.1 and out["staleness/mean"] == 0.5 and out["train/step"] == 4
    assert out["throughput/trained_tokens_per_s"] == (2 + 6 + 4 + 6) / 2.0
    assert out["response_length/truncated"] == 2 and out["response_length/truncated_ratio"] == 0.5
    assert out["response_length/p50"] == 5.0
    assert [out[f"staleness/hist/{k}"] for k in range(4)] == [2, 1, 1, 0]  # gaps 0, 0, 2, 1
    assert out["fully_async/count/stale_samples_processed"] == 2
    assert out["fully_async/count/dropped_stale_samples"] == 1
    assert out["fully_async/partial/total_partial_num"] == 2 and out["fully_async/partial/partial_ratio"] == 0.5
    assert [out[f"fully_async/partial/age_hist/{k}"] for k in range(3)] == [2, 1, 1]
    assert out["fully_async/count/current_param_version"] == 3
    assert all(is_known(name) for name in out), [n for n in out if not is_known(n)]
    assert src.take([]).samples == []  # take() resets


async def test_step_report_takes_the_launchers_step_time_and_the_trainers_wait():
    class Emitter:
        def emit_many(self, values, step, version):
            self.values = values

    class Result:
        step, version, sample_ids = 1, 1, ["sample_0_0"]
        metrics = {"loss": 0.1, "step": 1, "version": 1, "timing_s/step": 0.8, "timing_s/wait_data": 0.2}

    src = MeteredSource(_Source([_group("sample_0_0", [2, 6], [3, 3], [0, 1])]))
    await src.recv(timeout=1)
    emitter = Emitter()
    TrainerReporter(emitter, src).after_step(Result())
    # metrics.jsonl's figures, not the time between reports: the stream and the file agree.
    assert emitter.values["timing_s/step"] == 0.8 and emitter.values["timing_s/wait_data"] == 0.2
    assert emitter.values["fully_async/trainer/idle_ratio"] == pytest.approx(0.25)
    assert emitter.values["throughput/trained_tokens_per_s"] == pytest.approx((2 + 6) / 0.8)


async def test_rollouter_poll_reads_engines_rollouter_and_a_real_producer():
    from asyncrl.metrics.report import RolloutReporter
    from asyncrl.queue import StreamConfig, StreamProducer

    class Engine:
        def __init__(self, running, shared):
            self.running, self.tokens, self.groups, self.shared = running, 0, 0, shared

        def stats(self):
            # Each poll: 10 tokens and 2 group calls of 6 distinct prompt tokens; prefilled once
            # each when shared, else once per response of the group (n=4).
            self.tokens += 10
            self.groups += 2
            return {"running": self.running, "queued": 1, "kv_tokens": 5, "tokens_generated": self.tokens,
                    "groups": self.groups, "group_prompt_tokens": 6 * self.groups,
                    "group_prefill_tokens": 6 * self.groups * (1 if self.shared else 4),
                    "session_hits": self.running, "session_tokens_reused": 10 * self.running}

    class Rollouter:
        sent, admitted, failed, version = 3, 5, 1, 2
        idle_s = 0.0

        def stats_now(self):
            Rollouter.idle_s += 0.001  # idle a millisecond between two polls
            return {"idle_s": Rollouter.idle_s, "requests_spread": 0.25, "filter_dropped": 4}

    engines = [Engine(2, shared=True), Engine(4, shared=True)]
    producer = StreamProducer(StreamConfig(endpoint=f"tcp://127.0.0.1:{free_port()}", window=4))
    reporter = RolloutReporter(engines, n=8)
    first = await reporter.poll(Rollouter(), producer)
    second = await reporter.poll(Rollouter(), producer)
    assert (first["engine/0/running"], first["engine/1/running"], first["engine/running"]) == (2, 4, 6)
    assert first["fully_async/count/total_generated_samples"] == 24 and first["rollouter/in_flight"] == 2
    assert first["stream/unacked"] == 0 and first["stream/credit"] == 0  # no consumer: no credit
    assert "throughput/generated_tokens_per_s" not in first and second["throughput/generated_tokens_per_s"] > 0
    # From the first poll on (a short run may end before a second): idle since the reporter began.
    assert 0 < first["fully_async/rollouter/idle_ratio"] <= 1 and 0 < second["fully_async/rollouter/idle_ratio"] <= 1
    assert second["engine/requests_spread"] == 0.25 and second["rollouter/filtered_groups"] == 4
    assert (second["engine/session_hits"], second["engine/session_tokens_reused"]) == (6, 60)  # summed over engines
    assert second["engine/prefill_tokens_per_group"] == second["engine/prompt_tokens_per_group"] == 6
    assert "engine/prefix_cache_hit_rate" not in second  # no vLLM counters
    assert all(is_known(n) for n in second), [n for n in second if not is_known(n)]
    unshared = RolloutReporter([Engine(0, shared=False)], n=4)
    await unshared.poll(None, None)
    again = await unshared.poll(None, None)
    assert again["engine/prefill_tokens_per_group"] == 4 * again["engine/prompt_tokens_per_group"] == 24


def test_prefill_metrics_read_vllm_prefix_cache_counters():
    from asyncrl.metrics.report import engine_counters, prefill_metrics

    last = engine_counters([{"groups": 1, "prompt_tokens_computed": 10, "prompt_tokens_cached": 0}])
    now = engine_counters([{"groups": 3, "prompt_tokens_computed": 20, "prompt_tokens_cached": 30,
                            "group_prompt_tokens": 20, "group_prefill_tokens": 10}])
    out = prefill_metrics(last, now)
    assert out == {"engine/prefill_tokens_per_group": 5.0, "engine/prompt_tokens_per_group": 10.0,
                   "engine/prefix_cache_hit_rate": 0.75}


def test_wandb_sink_writes_an_offline_run_with_the_events(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import re

    from asyncrl.metrics.sinks.wandb import WandbSink

    monkeypatch.delenv("WANDB_MODE", raising=False)  # the sink's default: offline, no account needed
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink(MetricsConfig(sinks=("wandb",)), tmp_path)
    try:
        for step in (1, 2, 3):
            sink.write(_events(step))
    finally:
        sink.close()
    [run_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()
    # wandb's service process writes the file on its own: finish() can return before the last
    # records land on a loaded machine. Wait for every step's record, with a deadline.
    deadline = time.monotonic() + 60
    while data.count(b"trainer/step") < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
        data = run_file.read_bytes()

    def logged(key: str) -> list:
        """The JSON values recorded under ``key``: each history item is the key, then its
        ``value_json`` field (protobuf field 16: tag bytes 0x82 0x01, a length byte, the text)."""
        out = []
        for m in re.finditer(re.escape(key.encode()) + rb"\x82\x01", data):
            n = data[m.end()]
            out.append(json.loads(data[m.end() + 1:m.end() + 1 + n]))
        return out

    # Every value of every step, in order (wandb records each in the history and the summary).
    assert sorted(set(logged("train/reward_mean"))) == [0.1, 0.2, 0.30000000000000004]
    assert sorted(set(logged("engine/0/running"))) == [4, 5, 6]
    assert set(logged("fully_async/trainer/idle_ratio")) == {0.5}
    assert sorted(set(logged("trainer/step"))) == [1, 2, 3]
