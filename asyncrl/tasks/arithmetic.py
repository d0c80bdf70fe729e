"""The built-in verifiable task: small integer addition, ``"12+7="`` -> ``"19"``.

A prompt is ``a+b=`` with ``0 <= a, b <= max_operand``; the answer is the decimal sum followed
by the tokenizer's EOS. The reward is rule-based: 1.0 when the response (up to EOS, spaces
stripped) is exactly the sum, else 0.0. The dataset generator is seeded, so a run's prompts
are reproducible. Rows follow verl's column names where they fit (``prompt``, ``data_source``,
``reward_model.ground_truth``).

Long-tail variant (``long_tail_factor > 1``, for benchmarks): each row also carries its own
response budget, ``max_tokens``, drawn once per prompt from a seeded long-tail distribution
(`long_tail_budget`): most prompts get the task's ``max_response_tokens`` (the median), a few
up to ``long_tail_factor`` times it. Run it on engines that do not stop at EOS, so every
response really is generated to its budget; the reward still reads the text before the first
EOS.

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
    long_tail_factor: int = 1
    """1: every row has the same budget; a power of 2 above 1: rows carry a long-tail ``max_tokens``
    of up to this many times ``max_response_tokens`` (`long_tail_budget`)."""

    def __post_init__(self) -> None:
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        need = len(str(2 * self.max_operand)) + 1
        if self.max_response_tokens < need:
            raise ValueError(
                f"max_response_tokens={self.max_response_tokens} cannot hold an answer of "
                f"max_operand={self.max_operand} plus EOS: set it to at least {need}"
            )
        f = self.long_tail_factor
        if f < 1 or f & (f - 1):
            raise ValueError(f"long_tail_factor must be 1 or a power of 2, got {f}")


def long_tail_budget(rng: np.random.Generator, median: int, factor: int) -> int:
    """A response budget ``median * 2**k``: ``k = 0`` with probability 0.7, the other 0.3 over
    ``k = 1..log2(factor)`` in falling weights ``top, top-1, .., 1`` (factor 16: 0.70, 0.12, 0.09,
    0.06, 0.03 for 1x, 2x, 4x, 8x, 16x the median; mean 2.25x the median)."""
    probs = long_tail_probs(factor)
    if len(probs) == 1:
        return median
    return median * 2 ** int(rng.choice(len(probs), p=probs))


def long_tail_probs(factor: int) -> np.ndarray:
    """``P(k)`` for ``k = 0..log2(factor)`` of `long_tail_budget`."""
    top = factor.bit_length() - 1
    tail = np.arange(top, 0, -1, dtype=float)  # k=1 most likely, k=top least
    return np.concatenate([[0.7], 0.3 * tail / tail.sum()]) if top else np.ones(1)


def make_problem(rng: np.random.Generator, config: ArithmeticTaskConfig) -> tuple[str, str]:
    """One ``(prompt_text, answer_text)`` pair."""
    a, b = (int(x) for x in rng.integers(0, config.max_operand + 1, size=2))
    return f"{a}+{b}=", str(a + b)


def generate_dataset(n: int, seed: int = 0, config: ArithmeticTaskConfig | None = None) -> list[dict]:
    """``n`` seeded rows: ``{"prompt", "answer", "data_source", "reward_model": {"ground_truth"}}``."""
    config = config or ArithmeticTaskConfig()
    rng = np.random.default_rng(seed)
    lengths = np.random.default_rng([seed, 1])  # its own stream: the problems do not change with it
    rows = []
    for _ in range(n):
        prompt, answer = make_problem(rng, config)
        row = {
            "prompt": prompt,
            "answer": answer,
            "data_source": DATA_SOURCE,
            "reward_model": {"style": "rule", "ground_truth": answer},
        }
        if config.long_tail_factor > 1:
            row["max_tokens"] = long_tail_budget(lengths, config.max_response_tokens, config.long_tail_factor)
        rows.append(row)
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
    """Token ids of BOS (when the tokenizer has one) + prompt, int64 (the tiny tokenizer adds no
    special tokens by itself)."""
    ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    return np.asarray([*bos, *ids], dtype=np.int64)


def decode_response(tokenizer, response_ids) -> str:
    """Response text up to (not including) the first EOS."""
    ids = [int(t) for t in response_ids]
    if tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode(ids, skip_special_tokens=True)
