"""Envs and loops the agent tests name by path (``rollout.agent.env=tests.unit.agent_envs:LookupEnv``)."""

from __future__ import annotations

import asyncio

from asyncrl.agent import AgentLoop, Env, Step, ToolEnv, tool


@tool
def lookup(key: str) -> str:
    """Look up a key.

    Args:
        key: the key
    """
    return key.upper()


class LookupEnv(ToolEnv):
    """One @tool; the task's reward function scores the final answer."""

    def __init__(self):
        super().__init__([lookup])


class GatedLookupEnv(ToolEnv):
    """``lookup`` as an async tool that waits for the test's go (a weight sync lands meanwhile)."""

    called: asyncio.Event | None = None
    go: asyncio.Event | None = None

    def __init__(self):
        async def gated_lookup(key: str) -> str:
            """Look up a key.

            Args:
                key: the key
            """
            type(self).called.set()
            await type(self).go.wait()
            return key.upper()

        super().__init__([tool(gated_lookup, name="lookup")])


class ExplodingEnv(Env):
    """Raises in `step` on a prompt that says "explode" (a user's bug on some prompts only)."""

    async def reset(self, prompt):
        self.text = prompt.text
        return [{"role": "user", "content": prompt.text}]

    async def step(self, text):
        if "explode" in self.text:
            raise RuntimeError(f"env exploded on {self.text!r}")
        return Step(observation=[], done=True)


class TwoSessions(AgentLoop):
    """A multi-output loop: two one-turn conversations per prompt; drops the second when the
    prompt says so."""

    async def run(self, prompt, llm):
        from asyncrl.agent.loop import SingleTurnLoop

        first = await SingleTurnLoop(max_tokens=4).run(prompt, llm)
        if "drop" in prompt.text:
            return [first]
        llm.session()
        return [first, await SingleTurnLoop(max_tokens=4).run(prompt, llm)]


class NoStep:
    async def reset(self, prompt):
        return prompt.text


def _no_hints(key):
    """Look up a key.

    Args:
        key: the key
    """
    return key


class UnhintedToolEnv(ToolEnv):
    def __init__(self):
        super().__init__([_no_hints])


class LongSecondTurn(AgentLoop):
    """Two turns around a fixed two-token observation; the second is long for prompts named "long"
    (the partial-rollout test's long tail, inside a conversation)."""

    async def run(self, prompt, llm):
        import numpy as np

        from asyncrl.agent import OBSERVATION_VERSION, AgentTrajectory

        first = await llm.generate(prompt.prompt_ids, max_tokens=3)
        obs = np.array([6, 7], dtype=np.int64)
        ids = np.concatenate([prompt.prompt_ids, first.token_ids, obs])
        second = await llm.generate(ids, max_tokens=48 if prompt.text == "long" else 3)
        return AgentTrajectory(
            prompt_ids=prompt.prompt_ids, response_ids=np.concatenate([first.token_ids, obs, second.token_ids]),
            loss_mask=np.concatenate([np.ones(len(first.token_ids)), np.zeros(2), np.ones(len(second.token_ids))]),
            logprobs=np.concatenate([first.logprobs, np.zeros(2), second.logprobs]),
            versions=np.concatenate([first.versions, [OBSERVATION_VERSION] * 2, second.versions]),
            finish_reason=second.finish_reason, turns=2, reward=1.0)


class HangingLookupEnv(ToolEnv):
    """``lookup`` as an async tool that never returns (it ends only by ``tool_timeout_s``), counting
    the calls running at once (``running``, the most seen in ``most``)."""

    running = 0
    most = 0

    def __init__(self):
        async def hanging_lookup(key: str) -> str:
            """Look up a key.

            Args:
                key: the key
            """
            cls = type(self)
            cls.running += 1
            cls.most = max(cls.most, cls.running)
            try:
                await asyncio.Event().wait()
            finally:
                cls.running -= 1

        super().__init__([tool(hanging_lookup, name="lookup")])


class ThreeFixedTurns(AgentLoop):
    """Three 6-token turns around a fixed 4-token observation, whatever the model writes (a random
    model's conversation on vLLM: only the turns' tokens, log-probs and prefix-cache hits matter)."""

    async def tool_call(self, k: int) -> None:
        """Where a tool call's wall time would go: before the observation ahead of turn ``k``."""

    async def run(self, prompt, llm):
        import numpy as np

        from asyncrl.agent import OBSERVATION_VERSION, AgentTrajectory

        obs = np.array([20, 21, 22, 23], dtype=np.int64)
        ids, mask, logprobs, versions = [], [], [], []
        for k in range(3):
            if k:
                await self.tool_call(k)
                ids += obs.tolist()
                mask += [0] * len(obs)
                logprobs += [0.0] * len(obs)
                versions += [OBSERVATION_VERSION] * len(obs)
            turn = await llm.generate(np.concatenate([prompt.prompt_ids, np.asarray(ids, np.int64)]), max_tokens=6)
            ids += turn.token_ids.tolist()
            mask += [1] * len(turn.token_ids)
            logprobs += turn.logprobs.tolist()
            versions += turn.versions.tolist()
        return AgentTrajectory(prompt_ids=prompt.prompt_ids, response_ids=ids, loss_mask=mask, logprobs=logprobs,
                               versions=versions, finish_reason=turn.finish_reason, turns=3, reward=1.0)


class GatedThreeTurns(ThreeFixedTurns):
    """`ThreeFixedTurns` whose first "tool call" waits for the test's go, as `GatedLookupEnv`'s
    does (a weight sync lands meanwhile), with no chat template needed."""

    called: asyncio.Event | None = None
    go: asyncio.Event | None = None

    async def tool_call(self, k: int) -> None:
        if k == 1:
            type(self).called.set()
            await type(self).go.wait()


def exact_answer(data_source, solution_str, ground_truth, extra_info=None):
    """A verl-style reward: 1 when the final answer is the ground truth."""
    return float(solution_str.strip() == ground_truth)


class KeyedLookupEnv(ToolEnv):
    """``lookup`` with the call's key (an async tool, so it can note the keys in this process)."""

    keys: list[str] = []

    def __init__(self):
        async def keyed_lookup(key: str, call_key: str) -> str:
            """Look up a key.

            Args:
                key: the key
            """
            type(self).keys.append(call_key)
            return key.upper()

        super().__init__([tool(keyed_lookup, name="lookup")])
