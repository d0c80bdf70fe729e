"""`RolloutWorker`: the Rollouter process (a Ray actor): tokenizer, prompts, reward, stream producer, `Rollouter`.

The launcher builds it with plain values (configs, engine handles, the stream's settings) and
calls `run`; the Trainer's side calls `on_sync` after every weight sync and `feed_state` for
its checkpoints. Prompts come from a verl-layout file (`asyncrl.data`) or, with none given,
the built-in arithmetic task. Data and reward were checked by the launcher before Ray
started; here they are loaded again in the process that uses them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter, RolloutState

BUILTIN_TASK_ROWS = 4096
"""Prompts of the built-in task per epoch."""


@dataclasses.dataclass(kw_only=True)
class DataSpec:
    """Where the prompts and the reward come from (plain values: it crosses Ray)."""

    train: str | None = None
    """verl-layout JSONL/parquet; None: the built-in arithmetic task."""
    reward: str | None = None
    """``module:function``; None: the built-in task's reward."""
    seed: int = 0
    """Seed of the built-in task's prompts."""


def load_prompts(tokenizer, spec: DataSpec) -> list[Prompt]:
    """The dataset's rows as `Prompt`s (text as the model sees it, token ids, reward meta)."""
    from asyncrl import data

    if spec.train is None:
        from asyncrl.tasks import arithmetic

        rows = arithmetic.generate_dataset(BUILTIN_TASK_ROWS, seed=spec.seed)
        return [Prompt(text=r["prompt"], prompt_ids=arithmetic.encode_prompt(tokenizer, r["prompt"]),
                       meta={"data_source": r["data_source"], "ground_truth": r["reward_model"]["ground_truth"],
                             "extra_info": {}}) for r in rows]
    rows = data.read_rows(spec.train)
    data.check_renderable(tokenizer, rows, spec.train)
    prompts = []
    for row in rows:
        text, ids = data.prompt_text_and_ids(tokenizer, row)
        prompts.append(Prompt(text=text, prompt_ids=ids, meta=row.reward_meta))
    return prompts


def make_reward_fn(tokenizer, spec: DataSpec):
    """``reward_fn(prompt, response_ids)`` for the `Rollouter`: decode, then the user's (or built-in) reward."""
    from asyncrl import data

    reward = data.load_reward(spec.reward or data.BUILTIN_REWARD)

    async def reward_fn(prompt: Prompt, response_ids: np.ndarray) -> float:
        return await reward(prompt.text, prompt.meta, data.decode_response(tokenizer, response_ids))

    return reward_fn


class RolloutWorker:
    """The Rollouter process; build it as a Ray actor (``ray.remote(RolloutWorker)``)."""

    def __init__(self, cfg: RolloutConfig, engines: list, stream, model_path: str, data_spec: DataSpec,
                 resume: dict | None = None):
        """``resume``: ``{"saved": <the checkpoint's rollouter_state>, "committed": <CommittedSet
        JSON>, "dropped": int}`` of a restored Trainer: the feed continues where it stood, and
        what was admitted but not trained is generated again first (`RolloutState.resume`)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.cfg, self.engines, self.stream = cfg, engines, stream
        self.prompts = load_prompts(tokenizer, data_spec)
        self.reward_fn = make_reward_fn(tokenizer, data_spec)
        if resume is None:
            self.state = RolloutState()
        else:
            from asyncrl.types import CommittedSet

            self.state = RolloutState.resume(resume["saved"], CommittedSet.from_json(resume["committed"]),
                                             resume["dropped"], rows=len(self.prompts))
        self.version = 0
        self.rollouter: Rollouter | None = None
        self._stopped = False

    def ready(self) -> int:
        """Returns once the dataset is loaded: the number of prompts."""
        return len(self.prompts)

    async def run(self, num_groups: int | None = None) -> dict:
        """Feed prompts and send groups until ``num_groups`` were sent (forever when None)."""
        from asyncrl.queue import StreamProducer

        producer = StreamProducer(self.stream, producer_id="rollouter-0")
        await producer.start()
        self.rollouter = Rollouter(self.cfg, self.engines, producer, self.prompts, self.reward_fn, state=self.state)
        await self.rollouter.on_sync(self.version)  # a sync may have landed before run() started
        if self._stopped:
            await self.rollouter.stop()
        try:
            await self.rollouter.run(num_groups)
        finally:
            await producer.close()
        return self.progress()

    async def on_sync(self, version: int) -> None:
        """The engines now serve ``version``: open the staleness gate for it."""
        self.version = version
        if self.rollouter is not None:
            await self.rollouter.on_sync(version)

    async def stop(self) -> dict:
        """Drain: no new prompts, in-flight groups cancelled and aborted on the engines; `run` returns."""
        self._stopped = True
        if self.rollouter is not None:
            await self.rollouter.stop()
        return self.progress()

    def feed_state(self) -> dict:
        """The feed position and what is in flight, for the Trainer's checkpoint (``rollouter_state``)."""
        if self.rollouter is not None:
            return self.rollouter.snapshot()
        st = self.state
        return {"epoch": st.epoch, "next_index": st.next_index, "position": st.position}

    def progress(self) -> dict:
        r = self.rollouter
        return {} if r is None else {"admitted": r.admitted, "sent": r.sent, "failed": r.failed,
                                     "next_index": r.state.next_index}
