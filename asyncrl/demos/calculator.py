"""The warm-start recipe of the calculator task's policy (`asyncrl.tasks.calculator`).

``default_model_path("calculator")`` is the result as shipped (``asyncrl/models/tiny_calc/``);
``scripts/make_calculator_model.py`` runs this recipe to rebuild it. Like the addition demo's
model (`asyncrl.demos.warm_start`), it is built once and shipped, not trained at first use.

The model is the tiny Qwen2 of `asyncrl.models.tiny` over the tiny chat tokenizer
(`asyncrl.models.tiny_chat`, its template naming the tools in one line). The supervised phase
shows it whole conversations, token for token as the agent loop renders them
(`asyncrl.agent.ChatRenderer`): on a fraction ``tool_rate`` of them the first turn calls the
calculator with the question's expression and the second copies the tool's result; on the
others the first turn is the product written straight away, which a model this small cannot
compute. So sampled at temperature 1 it calls the tool on about ``tool_rate`` of its answers,
copies the result well when it does, and mostly misses when it does not: a group of 8 mixes
rewards, and RL has one decision to move (call the tool) for a large gain.

`measure` runs the model through the real agent loop (`EnvLoop` over the built-in engine, in
process) and reports the reward and the tool-call rate, greedy and sampled.
"""

from __future__ import annotations

import asyncio
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from asyncrl.models.tiny import TINY_CONFIG
from asyncrl.demos.warm_start import file_sha256, sft_step
from asyncrl.tasks.calculator import CalculatorEnv, CalculatorTaskConfig, generate_dataset, make_problem

RECIPE_VERSION = 1
#: Where the shipped policy's sampled (T=1) rewards must lie for the demo to learn with margin:
#: high enough that groups of 8 often hold a success, low enough to climb +0.2.
DEMO_SAMPLED_BAND = (0.15, 0.45)
MAX_TURNS, MAX_TOKENS_PER_TURN, MAX_CONTEXT_TOKENS = 3, 64, 256
"""The task's agent-loop limits (``--task calculator`` sets them as ``rollout.agent.*``)."""


@dataclass(kw_only=True)
class CalculatorWarmStartConfig:
    """Settings of the supervised phase."""

    copy_steps: int = 400
    """First phase: optimizer steps on tool-calling conversations only, their first token out of
    the loss (the format and the copy; mixed with direct answers from the start, the copy was not
    learned in 600 steps: the hopeless multiplication's loss drowned it)."""
    steps: int = 100
    """Second phase: optimizer steps on the mixture (``tool_rate``) plus ``copy_batch`` copies."""
    batch_size: int = 64
    """Conversations per step."""
    lr: float = 3e-3
    """AdamW learning rate (constant)."""
    tool_rate: float = 0.45
    """Fraction of the mixture's conversations that call the calculator (the rest answer directly).
    Sampled at T=1 the model then calls it on ~1/3 of its answers (on 128 held-out problems 0.3
    gave 0.16 and a sampled reward of 0.15, 0.45 gave 0.34 and 0.32; the shipped record, on 256:
    0.32 and 0.285)."""
    copy_batch: int = 64
    """More tool-calling conversations per step, with their first token out of the loss: they
    teach the call's format and copying the result without moving how often the tool is called."""
    seed: int = 0
    """Seed of the initial weights and of the supervised problems."""

    def __post_init__(self) -> None:
        for name in ("copy_steps", "steps", "copy_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0 <= self.tool_rate <= 1:
            raise ValueError(f"tool_rate must be in [0, 1], got {self.tool_rate}")


def build_calculator_model(path: str | Path, seed: int = 0) -> Path:
    """The tiny Qwen2 with random weights over the tool-names chat tokenizer, saved to ``path``."""
    from transformers import Qwen2Config

    from asyncrl.models.tiny_chat import CHATML_TOOL_NAMES_TEMPLATE, build_chat_tokenizer
    from asyncrl.models.tiny import save_random_model

    tok = build_chat_tokenizer(CHATML_TOOL_NAMES_TEMPLATE)
    cfg = Qwen2Config(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      **{**TINY_CONFIG, "max_position_embeddings": MAX_CONTEXT_TOKENS})
    return save_random_model(cfg, tok, path, seed)


def conversation(renderer, tools, prompt: str, answer: str, call_tool: bool,
                 decide: bool = True) -> tuple[list[int], list[float]]:
    """One supervised conversation's ids and loss mask (1 on the model's turns, end-of-turn included;
    ``decide=False``: 0 on the first model token, whether to call the tool)."""
    enc, stop = renderer.encode, list(renderer.stop_ids)
    ids = renderer.prompt_ids([{"role": "user", "content": prompt}], tools)
    mask = [0.0] * len(ids)
    if call_tool:
        expression = prompt.rstrip("=")
        call = enc('<tool_call>{"name":"calculator","arguments":{"expression":"%s"}}</tool_call>' % expression) + stop
        obs = renderer.observation_ids(call, [{"role": "tool", "name": "calculator", "content": answer}])
        ids, mask = ids + call + obs, mask + [1.0] * len(call) + [0.0] * len(obs)
    final = enc(answer) + stop
    ids, mask = ids + final, mask + [1.0] * len(final)
    if not decide:
        mask[mask.index(1.0)] = 0.0
    return ids, mask


def warm_start(path: str | Path, *, config: CalculatorWarmStartConfig, task: CalculatorTaskConfig | None = None,
               eval_prompts: int = 256) -> dict:
    """Build the model in ``path``, run the supervised phase, save it and ``warm_start.json``; returns the latter."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.agent.render import ChatRenderer
    from asyncrl.models import load_tokenizer

    task = task or CalculatorTaskConfig()
    path = Path(path)
    build_calculator_model(path, seed=config.seed)
    tok = load_tokenizer(path)
    renderer, tools = ChatRenderer(tok), CalculatorEnv().tools
    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    rng = np.random.default_rng(config.seed)
    started = time.monotonic()
    for step in range(config.copy_steps + config.steps):
        seqs, masks = [], []
        deciding = 0 if step < config.copy_steps else config.batch_size
        for i in range(config.batch_size + config.copy_batch):
            prompt, answer = make_problem(rng, task)
            decide = i < deciding
            call_tool = bool(rng.random() < config.tool_rate) if decide else True
            ids, mask = conversation(renderer, tools, prompt, answer, call_tool, decide)
            seqs.append(ids)
            masks.append(mask)
        sft_step(model, opt, seqs, masks, pad_id=tok.pad_token_id)
    model.eval()
    model.save_pretrained(path)
    info = {
        "recipe_version": RECIPE_VERSION, "settings": asdict(config), "task": asdict(task),
        "model": {**TINY_CONFIG, "max_position_embeddings": MAX_CONTEXT_TOKENS},
        "built_with": {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                       "machine": platform.machine(), "python": platform.python_version()},
        "train_seconds": round(time.monotonic() - started, 1),
        "eval_prompts": eval_prompts,
        "greedy": measure(path, eval_prompts, seed=10_000 + config.seed, greedy=True),
        "sampled_t1": measure(path, eval_prompts, seed=10_000 + config.seed, greedy=False),
    }
    info["model_sha256"] = file_sha256(path / "model.safetensors")
    (path / "warm_start.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def measure(path: str | Path, prompts: int, *, seed: int, greedy: bool) -> dict:
    """``{"reward", "tool_calls_per_conversation", "turns"}`` of the model at ``path`` on ``prompts``
    held-out problems, through `EnvLoop` over the built-in engine in this process."""
    return asyncio.run(_measure(str(path), prompts, seed, greedy))


async def _measure(path: str, prompts: int, seed: int, greedy: bool) -> dict:
    from asyncrl.agent import EngineLLM, EnvLoop, EnvLoopConfig
    from asyncrl.models import load_tokenizer
    from asyncrl.rollouter.engines import make_engine
    from asyncrl.tasks.calculator import reward
    from asyncrl.types import SamplingParams

    tok = load_tokenizer(path)
    engine = make_engine("torch", model_path=path, seed=seed)
    loop = EnvLoop(CalculatorEnv, tok, EnvLoopConfig(max_turns=MAX_TURNS, max_tokens_per_turn=MAX_TOKENS_PER_TURN,
                                                     max_context_tokens=MAX_CONTEXT_TOKENS))
    rows = generate_dataset(prompts, seed=seed)

    async def one(i: int, row: dict):
        sampling = SamplingParams(greedy=True) if greedy else SamplingParams(temperature=1.0, seed=seed * 1000 + i)
        traj = await loop.run(row["prompt"], EngineLLM(engine, sampling, request_id=f"eval{i}"))
        return reward(row["prompt"], traj.final_text), traj

    try:
        done = await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
    finally:
        await engine.close()
    return {"reward": float(np.mean([r for r, _ in done])),
            "tool_calls_per_conversation": float(np.mean([t.tool_calls for _, t in done])),
            "turns": float(np.mean([t.turns for _, t in done]))}
