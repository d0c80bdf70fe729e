"""The built-in verifiable task: small integer addition, ``"12+7="`` -> ``"19"``.

A prompt is ``a+b=`` with ``0 <= a, b <= max_operand``; the answer is the decimal sum followed
by the tokenizer's EOS. The reward is rule-based: 1.0 when the response (up to EOS, spaces
stripped) is exactly the sum, else 0.0. The dataset generator is seeded, so a run's prompts
are reproducible. Rows follow verl's column names where they fit (``prompt``, ``data_source``,
``reward_model.ground_truth``).

Left out: other operators, multi-step problems, partial credit (a binary reward keeps the
GRPO group statistics easy to read).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

DATA_SOURCE = "asyncrl/arithmetic"
_PROMPT = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*=\s*$")


@dataclass(kw_only=True)
class ArithmeticTaskConfig:
    """Settings of the addition task."""

    max_operand: int = 49
    """Largest operand; answers are at most ``2 * max_operand``."""
    max_response_tokens: int = 6
    """Response budget that fits any answer plus EOS with room for a wrong longer one."""

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        need = len(str(2 * self.max_operand)) + 1
        if self.max_response_tokens < need:
            raise ValueError(
                f"max_response_tokens={self.max_response_tokens} cannot hold an answer of "
                f"max_operand={self.max_operand} plus EOS: set it to at least {need}"
            )


def make_problem(rng: np.random.Generator, config: ArithmeticTaskConfig) -> tuple[str, str]:
    """One ``(prompt_text, answer_text)`` pair."""
    a, b = (int(x) for x in rng.integers(0, config.max_operand + 1, size=2))
    return f"{a}+{b}=", str(a + b)


def generate_dataset(n: int, seed: int = 0, config: ArithmeticTaskConfig | None = None) -> list[dict]:
    """``n`` seeded rows: ``{"prompt", "answer", "data_source", "reward_model": {"ground_truth"}}``."""
    config = config or ArithmeticTaskConfig()
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        prompt, answer = make_problem(rng, config)
        rows.append(
            {
                "prompt": prompt,
                "answer": answer,
                "data_source": DATA_SOURCE,
                "reward_model": {"style": "rule", "ground_truth": answer},
            }
        )
    return rows


def solve(prompt_text: str) -> str:
    """The correct answer of an ``a+b=`` prompt; ValueError names a prompt of another form."""
    m = _PROMPT.match(prompt_text)
    if m is None:
        raise ValueError(f"arithmetic prompt must look like 'a+b=', got {prompt_text!r}")
    return str(int(m.group(1)) + int(m.group(2)))


def reward(prompt_text: str, response_text: str) -> float:
    """1.0 when the response is exactly the sum (text after an EOS marker is ignored), else 0.0."""
    answer = response_text.split("<eos>", 1)[0].replace("<pad>", "").strip()
    return 1.0 if answer == solve(prompt_text) else 0.0


def encode_prompt(tokenizer, prompt_text: str) -> np.ndarray:
    """Token ids of BOS + prompt, int64 (the tiny tokenizer adds no special tokens by itself)."""
    ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    return np.asarray([tokenizer.bos_token_id, *ids], dtype=np.int64)


def decode_response(tokenizer, response_ids) -> str:
    """Response text up to (not including) the first EOS."""
    ids = [int(t) for t in response_ids]
    if tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode(ids, skip_special_tokens=True)
