"""The Trainer's driver loop: receive groups, screen and assemble them, step, ack, sync, checkpoint.

One train step takes ``require_batches`` mini-batches of ``groups_per_batch`` complete groups
each; every mini-batch is one optimizer step on all ranks. After each step the trained
``sample_id``s are committed; every ``trigger_parameter_sync_step`` steps the `WeightSyncer`
pushes the new weights to the engines and returns the new version.

Acks follow durability: with checkpoints on, a step's groups are acked once the checkpoint
holding that step is published (so a crash never loses a group the producer already forgot);
without checkpoints they are acked right after the optimizer step. Groups dropped by policy
(incomplete with ``on_incomplete_group="drop"``, older than ``max_version_gap``, or marked by the
Rollouter's ``rollout.group_filter``: reason ``filtered``) are
counted and acked at once with their reason, and reported through ``on_dropped`` so the
Rollouter's staleness gate gets their budget back (else enough drops starve the Trainer).
Incomplete groups otherwise fail the run closed.

Each step's metrics add ``timing_s/wait_data`` (collecting the step's groups), ``timing_s/update_actor``,
``timing_s/save_checkpoint`` and the partial-rollout figures of the trained groups (verl's
``fully_async/partial/total_partial_num``, ``partial_ratio``, ``max_partial_span``: versions one
trajectory spans, ``age_mean``, ``age_max``); the step's wall time, weight-sync time and the idle
ratio come from the metric stream's reporter.
The groups of a step train in feed order, whatever order they arrived in, so the step's
floating-point sums do not depend on arrival timing.

Audit: with ``samples_path`` set, every trained or dropped group gets one line in
``samples.jsonl`` once its step is durable (`asyncrl.trainer.audit`). Stopping: after
`request_stop` a step still collecting its groups is abandoned (`StepAbandoned`: nothing of it
was trained, its groups stay unacked); a step already training finishes. `finish` then writes
the checkpoint that makes everything durable.

Groups replayed by the SkipManager (`asyncrl.skip.is_replayed`) get their token versions
re-based to the current version before screening, so ``max_version_gap`` judges them as
produced now rather than by the dumping run's timeline; their behaviour log-probs are kept
(see `Trainer._replayed`). ``replayed_groups`` counts them per step.

The source is a `asyncrl.queue.base.GroupSource` (``recv``/``ack``): the ZeroMQ `StreamConsumer`,
or `asyncrl.queue.memory.MemorySource` in one process; the syncer a `asyncrl.sync.base.WeightSyncer`. Leaves out: the metrics pipeline (each step returns a dict).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from asyncrl.calls import maybe_await
from asyncrl.queue.base import GroupSource
from asyncrl.queue.memory import MemorySource
from asyncrl.skip.rollout_skip import REPLAY_KEY, is_replayed, rebase_versions
from asyncrl.sync.base import WeightSyncer
from asyncrl.trainer import audit, checkpoint
from asyncrl.trainer.batch import FILTERED, USER_ERROR, assemble, screen_groups, shard_rows
from asyncrl.trainer.config import TrainerConfig
from asyncrl.trainer.ranks import RankGroup
from asyncrl.trainer.worker import merge_stats
from asyncrl.types import CommittedSet, Group, parse_sample_id

__all__ = ["GroupSource", "MemorySource", "StepAbandoned", "StepResult", "Trainer", "WeightSyncer"]


class StepAbandoned(Exception):
    """A stop was requested while a step was still collecting groups: nothing of it was trained."""


@dataclass
class StepResult:
    """What one train step did."""

    step: int
    version: int
    sample_ids: list[str]
    """Groups trained on in this step, in batch order."""
    dropped: list[tuple[str, str]] = field(default_factory=list)
    """Groups dropped by policy while collecting this step, with the reason."""
    metrics: dict[str, float] = field(default_factory=dict)


class Trainer:
    """Drives the ranks from a group source. Owns neither: the caller starts and closes them."""

    def __init__(self, cfg: TrainerConfig, ranks: RankGroup, source: GroupSource,
                 syncer: WeightSyncer | None = None, *,
                 rollouter_state: Callable[[], dict | Awaitable[dict]] | None = None,
                 on_dropped: Callable[[list[str]], Awaitable[None] | None] | None = None,
                 restored: checkpoint.TrainerState | None = None):
        """``rollouter_state`` is called at each checkpoint; what it returns (a JSON-able dict)
        is stored in the sidecar's ``rollouter_state`` slot. ``on_dropped(sample_ids)`` is
        called as soon as groups are dropped by policy (tell the Rollouter's gate). ``restored``:
        the state `checkpoint.load_latest` loaded into the ranks (the Trainer goes on from it)."""
        if ranks.world_size != cfg.world_size:
            raise ValueError(f"world_size={cfg.world_size} but {ranks.world_size} ranks were given")
        self.cfg = cfg
        self.ranks = ranks
        self.source = source
        self.syncer = syncer
        self.rollouter_state = rollouter_state
        self.on_dropped = on_dropped
        self.step = 0
        self.version = 0
        self.committed = CommittedSet()
        """sample_ids trained on or dropped by policy."""
        self.dropped = 0
        """How many of ``committed`` were dropped by policy."""
        self._durable = CommittedSet()
        self._unacked: list[str] = []
        self._records: list[audit.SampleRecord] = []  # audit lines waiting for their step to be durable
        self._log = audit.SampleLog(cfg.samples_path) if cfg.samples_path else None
        self._stop = asyncio.Event()
        self.broken: str | None = None
        """Set when a step failed while the ranks were training it: they may hold part of it, so
        no checkpoint is written from them any more (the last one stays the resume point)."""
        self.restored_rollouter_state: dict = {}
        self.sync_due = False
        """A weight sync was due after ``step`` and has not finished (set while it runs, and after
        a restore of a run that stopped in it); a checkpoint records it, `catch_up_sync` runs it."""
        if restored is not None:
            self._go_on_from(restored)

    async def restore(self) -> bool:
        """Load the latest checkpoint under ``checkpoint_dir`` if there is one; True if it did.

        Restores the ranks' model and optimizer, ``step``, ``version`` and ``committed``; give
        ``committed`` to the stream (``StreamConsumer(cfg, committed=trainer.committed)``) so
        replays of committed groups are acked, not delivered. The Rollouter's saved state is in
        ``restored_rollouter_state``. ``samples.jsonl`` is repaired to list exactly the groups
        the checkpoint made durable (see `asyncrl.trainer.audit`)."""
        if (state := await checkpoint.load_latest(self.cfg, self.ranks)) is not None:
            self._go_on_from(state)
        return state is not None

    def _go_on_from(self, state: checkpoint.TrainerState) -> None:
        self.step, self.version, self.dropped = state.step, state.version, state.dropped
        self.sync_due = state.sync_due
        self.committed = CommittedSet.from_json(state.committed)
        self._durable = self.committed.copy()
        self._unacked, self._records = [], []
        self.restored_rollouter_state = state.rollouter_state
        if self._log is not None:
            self._log.repair(self.committed, state.records)

    async def catch_up_sync(self, syncer: WeightSyncer) -> bool:
        """After `restore`: run the weight sync the restored run stopped in, if any; True if it ran.

        Without it the restored ``version`` lags the weights by one sync, and the Rollouter's
        staleness budget (counted from the version) is one sync short: on-policy it admits
        nothing and the run waits forever for its next step's groups."""
        if not self.sync_due:
            return False
        self.version = await syncer.sync()
        self.sync_due = False
        return True

    def request_stop(self) -> None:
        """Stop at the next safe point: abandon a step still collecting, let one training finish."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def finish(self) -> None:
        """Make everything trained or dropped so far durable: a checkpoint if any of it is not."""
        if self.cfg.checkpoint_dir and (self._unacked or self._records):
            await self.save_checkpoint()

    async def run(self, num_steps: int) -> list[StepResult]:
        """Run ``num_steps`` train steps; the last one is always checkpointed (when enabled)."""
        results = [await self.train_step() for _ in range(num_steps)]
        await self.finish()
        return results

    async def _collect(self) -> tuple[list[Group], list[tuple[str, str]]]:
        need = self.cfg.groups_per_batch * self.cfg.require_batches
        kept: list[Group] = []
        dropped: list[tuple[str, str]] = []
        seen: set[str] = set()
        while len(kept) < need:
            try:
                group = await self._next_group()
            except TimeoutError:
                raise TimeoutError(f"no group arrived within recv_timeout_s={self.cfg.recv_timeout_s} "
                                   f"(step {self.step + 1} has {len(kept)} of {need})") from None
            if group.sample_id in self.committed or group.sample_id in seen:
                # A replay after a reconnect: ack again only what is durable, never train twice.
                if group.sample_id in self._durable:
                    self.source.ack([group.sample_id])
                continue
            seen.add(group.sample_id)
            if is_replayed(group):
                group = self._replayed(group)
            ok, out = screen_groups([group], on_incomplete=self.cfg.on_incomplete_group,
                                    max_version_gap=self.cfg.max_version_gap, current_version=self.version)
            kept.extend(ok)
            for sid, reason in out:
                self.source.ack([sid], reason=reason)
                self.committed.add(sid)
                self.dropped += 1
                self._records.append(audit.dropped(group, self.step + 1, reason))
                dropped.append((sid, reason))
            if out and self.on_dropped is not None:
                await maybe_await(self.on_dropped([sid for sid, _ in out]))
        return kept, dropped

    async def _next_group(self) -> Group:
        """The source's next group, unless a stop is requested first (`StepAbandoned`)."""
        if self._stop.is_set():
            raise StepAbandoned(f"stop requested while step {self.step + 1} was collecting groups")
        recv = asyncio.ensure_future(self.source.recv(timeout=self.cfg.recv_timeout_s))
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({recv, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if recv.done():
            return recv.result()
        recv.cancel()
        await asyncio.gather(recv, return_exceptions=True)
        # A group received meanwhile stays unacked: its producer keeps it, a resume regenerates it.
        raise StepAbandoned(f"stop requested while step {self.step + 1} was collecting groups")

    def _replayed(self, group: Group) -> Group:
        """A group the SkipManager replayed from a dump, made fit for this run (see `rebase_versions`).

        Its behaviour log-probs are kept: they are the probabilities under which its tokens were
        really sampled, so the importance ratio against them is correct whatever run dumped them
        (and exactly 1 before the first update when the replay starts from the same initial
        weights). They are only comparable with this Trainer's log-probs at the same
        temperature: a mismatch fails the run rather than train with wrong ratios.
        """
        temperature = group.meta[REPLAY_KEY].get("temperature")
        if temperature is not None and temperature != self.cfg.worker.algorithm.temperature:
            raise ValueError(f"replayed group {group.sample_id}: its behaviour log-probs were taken at temperature "
                             f"{temperature}, but algorithm.temperature={self.cfg.worker.algorithm.temperature}; "
                             "the importance ratios would be wrong (dump again with this temperature)")
        return rebase_versions(group, self.version)

    async def train_step(self) -> StepResult:
        """Collect the groups of one step, run its mini-batches, commit, maybe sync and checkpoint."""
        cfg = self.cfg
        t_start = time.perf_counter()
        groups, dropped = await self._collect()
        t_collected = time.perf_counter()
        groups.sort(key=_feed_order)
        per_batch = []
        batches = []
        for i in range(cfg.require_batches):
            chunk = groups[i * cfg.groups_per_batch:(i + 1) * cfg.groups_per_batch]
            batch = assemble(chunk, pad_token_id=cfg.worker.pad_token_id,
                             norm_adv_by_std=cfg.worker.algorithm.norm_adv_by_std,
                             stop_token_id=cfg.worker.stop_token_id)
            batches.append(batch)
            try:
                per_batch.append(await self._train_minibatch(batch))
            except BaseException as e:
                # The ranks may hold part of this step's updates: no checkpoint may record them.
                self.broken = f"step {self.step + 1} failed while training ({type(e).__name__}: {e})"
                raise
        ids = [g.sample_id for g in groups]
        self.step += 1
        self.committed.update(ids)
        self._unacked.extend(ids)
        self._records.extend(audit.trained(groups, self.step))
        if cfg.transcripts_path is not None:
            audit.append_transcripts(cfg.transcripts_path, groups, self.step)
        t_trained = time.perf_counter()
        if self.syncer is not None and self.step % cfg.trigger_parameter_sync_step == 0:
            self.sync_due = True  # until it finishes: a checkpoint after a failed sync says so
            self.version = await self.syncer.sync()
            self.sync_due = False
        t_synced = time.perf_counter()
        if cfg.checkpoint_dir is None:
            self._durable.update(ids)  # without checkpoints a committed step is as durable as it gets
            self._made_durable()
        elif self.step % cfg.checkpoint_every == 0:
            await self.save_checkpoint()
        t_end = time.perf_counter()
        metrics = _step_metrics(per_batch, batches, dropped)
        metrics.update(_partial_metrics(groups))
        metrics.update(_filter_metrics(len(groups), dropped))
        metrics.update(_agent_metrics(groups))
        # The metric stream's reporter (asyncrl.metrics.report) adds timing_s/step, param_sync and
        # fully_async/trainer/idle_ratio; these three only the Trainer knows.
        metrics.update({"timing_s/wait_data": t_collected - t_start, "timing_s/update_actor": t_trained - t_collected,
                        "timing_s/save_checkpoint": t_end - t_synced})
        metrics.update(step=self.step, version=self.version, replayed_groups=float(sum(map(is_replayed, groups))))
        return StepResult(step=self.step, version=self.version, sample_ids=ids, dropped=dropped, metrics=metrics)

    async def _train_minibatch(self, batch) -> dict[str, float]:
        mode = self.cfg.worker.algorithm.loss_agg_mode
        # A mini-batch of empty responses has no tokens: its loss is 0, not 0/0.
        denom = max(1.0, float(batch["response_mask"].sum()) if mode == "token-mean" else float(batch.batch_size[0]))
        shards = [(shard_rows(batch, self.ranks.world_size, r), denom) for r in range(self.ranks.world_size)]
        per_rank = await self.ranks.call("train_minibatch", shards, timeout=self.cfg.step_timeout_s)
        out = dict(per_rank[0])  # grad_norm and lr are global: every rank reports the same value
        for other in per_rank[1:]:
            merge_stats(out, {k: v for k, v in other.items() if k not in ("grad_norm", "lr")})
        out["_batch_version"] = self.version  # the version trained on, for staleness
        return out

    async def save_checkpoint(self) -> None:
        """Publish a checkpoint of the ranks and the sidecar, then log and ack the groups it made durable."""
        if self.broken:
            raise RuntimeError(f"no checkpoint: {self.broken}")
        root = self.cfg.checkpoint_dir
        staged = checkpoint.staging_path(root, self.step)
        # The Rollouter's snapshot first: taken after the ranks' save, it missed more of the truncated
        # responses that the sync had just released, resumed and finished meanwhile (nothing is
        # lost either way: a response not in it is generated again after a resume).
        rollouter_state = await maybe_await(self.rollouter_state()) if self.rollouter_state else {}
        await self.ranks.call("save_checkpoint", timeout=self.cfg.step_timeout_s, path=str(staged))
        state = checkpoint.TrainerState(
            step=self.step, version=self.version, committed=self.committed.to_json(), dropped=self.dropped,
            records=list(self._records), rollouter_state=rollouter_state, sync_due=self.sync_due,
        )
        checkpoint.publish(root, staged, state)
        self._durable = self.committed.copy()
        self._made_durable()

    def _made_durable(self) -> None:
        """Log, then ack, what is durable now (a crash between the two only re-sends acked-later groups)."""
        if self._log is not None:
            self._log.append(self._records)
        self._records = []
        if self._unacked:
            self.source.ack(self._unacked)
            self._unacked = []


def _feed_order(group: Group) -> tuple[int, str]:
    try:
        return parse_sample_id(group.sample_id)[1], group.sample_id
    except ValueError:
        return -1, group.sample_id  # ids not from a Rollouter's feed keep a stable order too


def _partial_metrics(groups: list[Group]) -> dict[str, float]:
    """verl's partial-rollout figures of the trained trajectories: how many were resumed after a
    truncation, their share, the most versions one trajectory spans, and their ages."""
    trajectories = [t for g in groups for t in g.trajectories]
    ages = [t.age for t in trajectories]
    spans = [int(v.max() - v.min()) for v in (t.model_versions for t in trajectories) if len(v)]
    partial = sum(a > 0 for a in ages)
    return {
        "fully_async/partial/total_partial_num": float(partial),
        "fully_async/partial/partial_ratio": partial / max(len(trajectories), 1),
        "fully_async/partial/max_partial_span": float(max(spans, default=0)),
        "fully_async/partial/age_mean": sum(ages) / max(len(ages), 1),
        "fully_async/partial/age_max": float(max(ages, default=0)),
    }


def _agent_metrics(groups: list[Group]) -> dict[str, float]:
    """Turns of the step's conversations (agent loops; nothing for single-turn responses)."""
    trajectories = [t for g in groups for t in g.trajectories]
    if not any(t.turns != 1 or t.loss_mask is not None for t in trajectories):
        return {}
    turns = [t.turns for t in trajectories]
    return {"agent/turns_mean": sum(turns) / len(turns), "agent/turns_max": float(max(turns))}


def _filter_metrics(trained: int, dropped: list[tuple[str, str]]) -> dict:
    """Dynamic sampling (``rollout.group_filter``) over the groups the step received: how many the
    filter dropped, the share it kept, and prompts generated per trained group (every drop counted)."""
    filtered = sum(r == FILTERED for _, r in dropped)
    return {"filter/dropped_groups": float(filtered), "filter/kept_ratio": trained / (trained + filtered),
            "filter/prompts_per_trained_group": (trained + len(dropped)) / trained,
            "user_errors/dropped_groups": float(sum(r.startswith(USER_ERROR + ":") for _, r in dropped))}


def _step_metrics(per_batch: list[dict], batches: list, dropped: list[tuple[str, str]]) -> dict:
    """Combine the ranks' per-mini-batch sums into the step's metrics."""
    tokens = sum(b["tokens"] for b in per_batch) or 1.0
    resp = torch.cat([(b["versions"] >= 0).sum(-1) for b in batches]).float()  # generated, trained or not
    gaps = torch.cat([
        (b["_batch_version"] - bt["versions"])[bt["response_mask"].bool()] for b, bt in zip(per_batch, batches)
    ]).float()
    rewards = torch.cat([bt["rewards"] for bt in batches])
    return {
        "loss": sum(b["loss"] for b in per_batch) / len(per_batch),
        "clip_frac": sum(b["clipped_tokens"] for b in per_batch) / tokens,
        "tis_truncated_frac": sum(b["truncated_tokens"] for b in per_batch) / tokens,
        "is_ratio_mean": sum(b["is_ratio_sum"] for b in per_batch) / tokens,
        "is_ratio_max": max(b["is_ratio_max"] for b in per_batch),
        "is_ratio_min": min(b["is_ratio_min"] for b in per_batch),
        "kl": sum(b["kl_sum"] for b in per_batch) / tokens,
        "entropy": sum(b["entropy_sum"] for b in per_batch) / tokens,
        "grad_norm": sum(b["grad_norm"] for b in per_batch) / len(per_batch),
        "lr": per_batch[-1]["lr"],
        "staleness_mean": float(gaps.mean()) if gaps.numel() else 0.0,
        "staleness_max": float(gaps.max()) if gaps.numel() else 0.0,
        "response_length_mean": float(resp.mean()),
        "response_length_max": float(resp.max()),
        "reward_mean": float(rewards.mean()),
        "groups": float(sum(int(bt["group_index"].max()) + 1 for bt in batches)),
        "dropped_incomplete": float(sum(r.startswith("incomplete") for _, r in dropped)),
        "dropped_stale": float(sum(r.startswith("stale") for _, r in dropped)),
    }
