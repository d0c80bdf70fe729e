"""`RolloutWorker`: the Rollouter process (a Ray actor): tokenizer, prompts, reward, stream producer, `Rollouter`.

The launcher builds it with plain values (configs, engine handles, the stream's settings, the
`AggregatorActor` with partial rollout in sync mode) and calls `run`; the Trainer's side calls
`on_pause` / `on_sync` around every weight sync, `on_dropped` when it drops groups by policy,
`feed_state` for its checkpoints and `stats` for each step's metrics. Prompts come from a verl-layout file (`asyncrl.data`) or, with none given,
the built-in arithmetic task. Data and reward were checked by the launcher before Ray
started; here they are loaded again in the process that uses them. `validate` scores the
validation file greedily on the same engines (through the agent loop, when one is configured).
The skip registry is per process, so this actor calls `SkipManager.init` with the run's
``skip`` config and the shape of its rollouts (model, prompts, reward, n, token budget, sampling).
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from asyncrl.rollouter.partial import PartialRolloutConfig
from asyncrl.calls import call_within
from asyncrl.rollouter.rewards import score
from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter, RolloutState, settle_gc
from asyncrl.types import GenerateRequest, SamplingParams
from asyncrl.skip import SkipConfig, SkipManager, model_fingerprint, prompts_fingerprint, rollout_shape

BUILTIN_TASK_ROWS = 4096
"""Prompts of the built-in task per epoch."""


@dataclasses.dataclass(kw_only=True)
class DataSpec:
    """Where the prompts and the reward come from (plain values: it crosses Ray)."""

    train: str | None = None
    """verl-layout JSONL/parquet; None: the built-in arithmetic task."""
    val: str | None = None
    """Validation file (same layout); None: no validation."""
    reward: str | None = None
    """``module:function``; None: the built-in task's reward."""
    seed: int = 0
    """Seed of the built-in task's prompts."""
    long_tail: int = 1
    """Built-in task: per-prompt response budgets up to this many times the median (1: off)."""
    task: str = "arithmetic"
    """The built-in task when there is no training file (``data.task``)."""


def load_prompts(tokenizer, spec: DataSpec, path: str | None = None) -> list[Prompt]:
    """The rows of ``path`` (default: the training file) as `Prompt`s (text as the model sees it,
    token ids, reward meta); the built-in task when there is no training file."""
    from asyncrl import data

    path = path or spec.train
    if path is None and spec.task == "calculator":
        from asyncrl.tasks import calculator

        rows = calculator.generate_dataset(BUILTIN_TASK_ROWS, seed=spec.seed)
        return builtin_task_prompts(tokenizer, rows)
    if path is None:
        from asyncrl.tasks import arithmetic

        task = arithmetic.ArithmeticTaskConfig(long_tail_factor=spec.long_tail)
        rows = arithmetic.generate_dataset(BUILTIN_TASK_ROWS, seed=spec.seed, config=task)
        return builtin_task_prompts(tokenizer, rows)
    rows = data.read_rows(path)
    data.check_renderable(tokenizer, rows, path)
    prompts = []
    for row in rows:
        text, ids = data.prompt_text_and_ids(tokenizer, row)
        prompts.append(Prompt(text=text, prompt_ids=ids, meta=row.reward_meta,
                              messages=None if isinstance(row.prompt, str) else row.prompt))
    return prompts


def builtin_task_prompts(tokenizer, rows: list[dict]) -> list[Prompt]:
    """Rows of a built-in task (``generate_dataset`` of `asyncrl.tasks.arithmetic` or `.calculator`) as `Prompt`s, each
    with its reward meta and, on the long-tail variant, its own response budget."""
    from asyncrl.tasks import arithmetic

    return [Prompt(text=r["prompt"], prompt_ids=arithmetic.encode_prompt(tokenizer, r["prompt"]),
                   meta={"data_source": r["data_source"], "ground_truth": r["reward_model"]["ground_truth"],
                         "extra_info": {}}, max_tokens=r.get("max_tokens")) for r in rows]


def make_reward_fn(tokenizer, spec: DataSpec):
    """``reward_fn(prompt, response_ids)`` for the `Rollouter`: decode, then the user's (or built-in) reward.

    A plain reward function gives a plain ``reward_fn``, which the Rollouter runs, decode included,
    on its reward threads (``rollout.reward_workers``), off its event loop; an ``async def`` one
    gives a coroutine function, awaited on the loop (it should not block)."""
    from asyncrl import data

    reward = data.load_reward(spec.reward or data.BUILTIN_REWARDS[spec.task])
    if reward.is_async:
        async def reward_fn(prompt: Prompt, response_ids: np.ndarray) -> float:
            return await reward(prompt.text, prompt.meta, data.decode_response(tokenizer, response_ids))

        return reward_fn

    def plain_reward_fn(prompt: Prompt, response_ids: np.ndarray) -> float:
        return reward.score(prompt.text, prompt.meta, data.decode_response(tokenizer, response_ids))

    return plain_reward_fn


class RolloutWorker:
    """The Rollouter process; build it as a Ray actor (``ray.remote(RolloutWorker)``)."""

    def __init__(self, cfg: RolloutConfig, engines: list, stream, model_path: str, data_spec: DataSpec,
                 resume: dict | None = None, *, metrics_endpoint: str | None = None, metrics_interval_s: float = 1.0,
                 skip: SkipConfig | None = None,
                 partial: PartialRolloutConfig | None = None, aggregator=None):
        """``resume``: ``{"saved": <the checkpoint's rollouter_state>, "committed": <CommittedSet
        JSON>, "dropped": int}`` of a restored Trainer: the feed continues where it stood, and
        what was admitted but not trained is generated again first (`RolloutState.resume`)."""
        from asyncrl.hang import enable_stack_dumps
        from asyncrl.models import load_tokenizer

        enable_stack_dumps()  # the launcher's hang watchdog asks every process where it waits
        tokenizer = load_tokenizer(model_path)
        self.cfg, self.engines, self.stream = cfg, engines, stream
        self.prompts = load_prompts(tokenizer, data_spec)
        self.val_prompts = load_prompts(tokenizer, data_spec, data_spec.val) if data_spec.val else []
        self.reward_fn = make_reward_fn(tokenizer, data_spec)
        from asyncrl.rollouter.agents import build_agent

        self.agent = build_agent(cfg.agent, tokenizer)  # None: plain single-turn generation
        # The skip registry is per process: the Rollouter's generate_group calls consult this one.
        SkipManager.init(skip, shape=rollout_shape(
            cfg, model=model_fingerprint(model_path),
            data=prompts_fingerprint((p.prompt_ids for p in self.prompts),
                                     data_spec.train or f"builtin:{data_spec.task}:seed={data_spec.seed}"),
            reward=data_spec.reward or "builtin",
            **({"agent": cfg.agent.env or cfg.agent.loop or cfg.agent.spec} if cfg.agent.enabled else {}),
            **({"endpoint_branches": cfg.agent.endpoint_branches} if cfg.agent.endpoint else {})))
        if resume is None:
            self.state = RolloutState()
        else:
            from asyncrl.types import CommittedSet

            self.state = RolloutState.resume(resume["saved"], CommittedSet.from_json(resume["committed"]),
                                             resume["dropped"], rows=len(self.prompts))
        self.partial, self.aggregator = partial, aggregator
        self.version = 0
        self.dropped: list[str] = []
        self.rollouter: Rollouter | None = None
        self.metrics_endpoint, self.metrics_interval_s = metrics_endpoint, metrics_interval_s
        self._stopped = False

    async def replace_engine(self, index: int, engine) -> None:
        """Replica ``index`` was started again and holds the current weights: use it."""
        self.engines[index] = engine  # (the metrics reporter reads this list)
        if self.aggregator is not None:
            await self.aggregator.replace_engine.remote(index, engine)
        if self.rollouter is not None:
            await self.rollouter.replace_engine(index, engine)

    def ready(self) -> int:
        """Returns once the dataset is loaded: the number of prompts."""
        return len(self.prompts)

    async def run(self, num_groups: int | None = None) -> dict:
        """Feed prompts and send groups until ``num_groups`` were sent (forever when None)."""
        from asyncrl.queue import StreamProducer

        producer = StreamProducer(self.stream, producer_id="rollouter-0")
        await producer.start()
        report = None
        if self.metrics_endpoint:  # metrics (#16): a periodic report beside the Rollouter
            from asyncrl.metrics.report import RolloutReporter, report_rollouter
            from asyncrl.metrics.stream import MetricsEmitter

            emitter = MetricsEmitter(self.metrics_endpoint, "rollouter")
            report = asyncio.create_task(report_rollouter(
                emitter, RolloutReporter(self.engines, self.cfg.n), lambda: (self.rollouter, producer),
                self.metrics_interval_s))
        self.rollouter = Rollouter(self.cfg, list(self.engines), producer, self.prompts, self.reward_fn, state=self.state,
                                   partial=self.partial, aggregator=self.aggregator, agent=self.agent)
        settle_gc()  # the process is set up: freeze its heap out of the collections of the run
        await self.rollouter.on_sync(self.version)  # a sync may have landed before run() started
        await self.rollouter.on_dropped(self.dropped)
        if self._stopped:
            await self.rollouter.stop()
        try:
            await self.rollouter.run(num_groups)
        finally:
            if report is not None:
                report.cancel()
                await asyncio.gather(report, return_exceptions=True)
                emitter.close()
            await producer.close()
            if self.agent is not None:
                await self.agent.aclose()
        return self.progress()

    async def on_pause(self) -> None:
        """A weight sync is about to pause the engines (request deadlines stand still)."""
        if self.rollouter is not None:
            await self.rollouter.on_pause()

    async def on_sync(self, version: int) -> None:
        """The engines now serve ``version``: release truncated responses, open the gate for it."""
        self.version = version
        if self.rollouter is not None:
            await self.rollouter.on_sync(version)

    async def stop(self) -> dict:
        """Drain: no new prompts, in-flight groups cancelled and aborted on the engines; `run` returns."""
        self._stopped = True
        if self.rollouter is not None:
            await self.rollouter.stop()
        return self.progress()

    async def on_dropped(self, sample_ids: list[str]) -> None:
        """The Trainer dropped these groups by policy: their budget goes back to the gate."""
        self.dropped.extend(sample_ids)
        if self.rollouter is not None:
            await self.rollouter.on_dropped(sample_ids)

    async def stats(self) -> dict:
        """Cumulative counters and timers (`RolloutStats`, ``time_s``) and the engines' counters
        behind the shared-prefill metrics (``engine_counters``; a replica that does not answer
        within 5 s counts nothing), for the step metrics."""
        if self.rollouter is None:
            return {}
        from asyncrl.metrics.report import engine_counters

        out = self.rollouter.stats_now()
        stats = await asyncio.gather(*(call_within(e, "stats", 5.0) for e in self.engines),
                                     return_exceptions=True)
        out["engine_counters"] = engine_counters([s for s in stats if isinstance(s, dict)])
        return out
    async def validate(self, step: int) -> dict[str, float]:
        """One greedy response per validation prompt, scored: metrics under ``val/``. With an agent
        loop (``rollout.agent.*``) the response is a greedy run of that loop, as in training
        (`validate_agent_response`; ``val/turns_mean`` counts its model turns).

        Request ids are ``val_{step}_{i}`` (``.../t{turn}`` for an agent loop's turns): they never
        take the form of a training ``sample_id`` (``sample_{epoch}_{index}``), never enter the
        stream and never move the feed.
        """
        if not self.val_prompts:
            return {}
        slots = asyncio.Semaphore(self.cfg.max_concurrent)

        async def one(i: int, prompt: Prompt) -> list[tuple[float, int, int]]:
            engine = self.engines[i % len(self.engines)]
            if self.agent is not None:
                from asyncrl.rollouter.agents import validate_agent_response

                async with slots:
                    return await validate_agent_response(self.agent, engine, f"val_{step}_{i}", prompt,
                                                         self.reward_fn, self.cfg.request_timeout_s)
            request = GenerateRequest(request_id=f"val_{step}_{i}", prompt_ids=prompt.prompt_ids,
                                      max_tokens=self.cfg.max_tokens, sampling=SamplingParams(greedy=True))
            async with slots:
                result = await call_within(engine, "generate", self.cfg.request_timeout_s, request)
            reward = await score(self.reward_fn, prompt, result.response_ids)
            return [(reward, len(result.response_ids), 1)]

        scored = [s for per_prompt in await asyncio.gather(*(one(i, p) for i, p in enumerate(self.val_prompts)))
                  for s in per_prompt]
        rewards = np.asarray([r for r, _, _ in scored], dtype=np.float64)
        out = {"val/reward_mean": float(rewards.mean()), "val/response_length_mean": float(np.mean([n for _, n, _ in scored])),
               "val/samples": float(len(scored))}
        if self.agent is not None:
            out["val/turns_mean"] = float(np.mean([t for _, _, t in scored]))
        return out

    def feed_state(self) -> dict:
        """The feed position and what is in flight, for the Trainer's checkpoint (``rollouter_state``)."""
        if self.rollouter is not None:
            return self.rollouter.snapshot()
        st = self.state
        return {"epoch": st.epoch, "next_index": st.next_index, "position": st.position}

    def progress(self) -> dict:
        r = self.rollouter
        return {} if r is None else {"admitted": r.admitted, "sent": r.sent, "failed": r.failed,
                                     "replayed": r.replayed, "next_index": r.state.next_index,
                                     "skip": SkipManager.stats()}
