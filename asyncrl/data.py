"""Datasets and rewards in verl's layout: read and checked before anything starts, rendered in the Rollouter.

A row (JSONL line or parquet row)::

    {"prompt": "12+7=" | [{"role": "user", "content": "..."}, ...],   # text, or chat messages
     "data_source": "gsm8k",                                          # optional, passed to the reward
     "reward_model": {"ground_truth": "19"},                          # optional, passed to the reward
     "extra_info": {...}}                                             # optional, passed to the reward

Chat messages are rendered with the tokenizer's chat template (``add_generation_prompt``);
text is tokenized as is. A reward is ``module:function`` with verl's signature
``compute_score(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float}``
or the short ``(prompt, response) -> float``; either may be ``async``. `read_rows` and
`load_reward` run in the launcher before Ray starts, so a bad row or reward fails at once,
naming the file and row or the function.

Left out: verl's built-in scorers by ``data_source`` (give the reward explicitly), multimodal
columns, prompt-length filtering.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.importpath import load_path

BUILTIN_REWARDS = {"arithmetic": "asyncrl.tasks.arithmetic:reward", "calculator": "asyncrl.tasks.calculator:reward"}
"""Each built-in task's reward (``data.task``), used when no dataset is given."""


class DataError(ValueError):
    """A dataset or reward that cannot be used; the message names the file and row, or the function."""


@dataclass
class Row:
    """One dataset row in verl's layout."""

    prompt: str | list[dict[str, str]]
    data_source: str | None = None
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)

    @property
    def reward_meta(self) -> dict[str, Any]:
        """What travels with the prompt to the reward (and in the group's meta)."""
        return {"data_source": self.data_source, "ground_truth": self.ground_truth, "extra_info": self.extra_info}


# ------------------------------------------------------------------------------- reading


def read_rows(path: str | Path) -> list[Row]:
    """Every row of a ``.jsonl``/``.json`` or ``.parquet`` file, checked; `DataError` names file and row."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.suffix == ".parquet":
        raw = _read_parquet(path)
    elif path.suffix in (".jsonl", ".json"):
        raw = _read_jsonl(path)
    else:
        raise DataError(f"{path}: unknown dataset format {path.suffix!r}; use .jsonl or .parquet")
    rows = [parse_row(r, f"{path}:{i}") for i, r in raw]
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        out.append((i, json.loads(line)))
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    return out


def _read_parquet(path: Path) -> list[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    if "prompt" not in table.column_names:
        raise DataError(f"{path}: no 'prompt' column (columns: {table.column_names})")
    # Rows are numbered from 1, as in the JSONL case.
    return list(enumerate(table.to_pylist(), 1))


def parse_row(raw: Any, where: str) -> Row:
    """One raw row -> `Row`; `DataError` says at ``where`` (file:row) what is wrong."""
    if not isinstance(raw, dict):
        raise DataError(f"{where}: a row must be an object, got {type(raw).__name__}")
    prompt = raw.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where}: 'prompt' is empty")
    elif isinstance(prompt, list) and prompt:
        for j, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: prompt message {j} must be {{'role': str, 'content': str}}, got {m!r:.80}")
    else:
        raise DataError(f"{where}: needs a 'prompt' (text, or a non-empty list of chat messages), "
                        f"got {type(prompt).__name__}")
    reward_model = raw.get("reward_model") or {}
    if not isinstance(reward_model, dict):
        raise DataError(f"{where}: 'reward_model' must be an object with 'ground_truth', got {type(reward_model).__name__}")
    extra = raw.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise DataError(f"{where}: 'extra_info' must be an object, got {type(extra).__name__}")
    source = raw.get("data_source")
    if source is not None and not isinstance(source, str):
        raise DataError(f"{where}: 'data_source' must be text, got {type(source).__name__}")
    return Row(prompt=prompt, data_source=source, ground_truth=reward_model.get("ground_truth"), extra_info=extra)


# ------------------------------------------------------------------------------ rendering


def prompt_text_and_ids(tokenizer, row: Row) -> tuple[str, np.ndarray]:
    """The prompt as the model sees it: chat messages through the chat template, text as is."""
    if isinstance(row.prompt, str):
        return row.prompt, np.asarray(tokenizer(row.prompt)["input_ids"], dtype=np.int64)
    text = tokenizer.apply_chat_template(row.prompt, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text, np.asarray(ids, dtype=np.int64)


def check_renderable(tokenizer, rows: list[Row], path: str) -> None:
    """Chat-message rows need a tokenizer with a chat template; fail naming the first such row."""
    if getattr(tokenizer, "chat_template", None):
        return
    for i, row in enumerate(rows, 1):
        if not isinstance(row.prompt, str):
            raise DataError(f"{path}:{i}: prompt is chat messages but the model's tokenizer has no chat template")


# -------------------------------------------------------------------------------- rewards


@dataclass
class Reward:
    """A reward function and how to call it: ``reward.score(row, response_text) -> float`` for a plain
    function (run it on a worker thread), ``await reward(row, response_text)`` for either kind."""

    spec: str
    fn: Callable[..., Any]
    verl_style: bool

    @property
    def is_async(self) -> bool:
        """The user's function is a coroutine function (awaited on the event loop, not on a thread)."""
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None))

    def _call(self, prompt_text: str, meta: dict[str, Any], response_text: str) -> Any:
        if self.verl_style:
            return self.fn(data_source=meta.get("data_source"), solution_str=response_text,
                           ground_truth=meta.get("ground_truth"), extra_info=meta.get("extra_info") or {})
        return self.fn(prompt_text, response_text)

    def _value(self, out: Any) -> float:
        if isinstance(out, dict):  # verl's scorers may return {"score": ..., other diagnostics}
            if "score" not in out:
                raise DataError(f"reward {self.spec} returned a dict without 'score': {sorted(out)}")
            out = out["score"]
        return float(out)

    def score(self, prompt_text: str, meta: dict[str, Any], response_text: str) -> float:
        """The reward of a plain (synchronous) function, called in this thread."""
        out = self._call(prompt_text, meta, response_text)
        if inspect.isawaitable(out):
            close = getattr(out, "close", None)
            if close is not None:
                close()  # never awaited: say so once, here, not as a warning at garbage collection
            raise DataError(f"reward {self.spec} returned an awaitable from a plain function: make it `async def`")
        return self._value(out)

    async def __call__(self, prompt_text: str, meta: dict[str, Any], response_text: str) -> float:
        out = self._call(prompt_text, meta, response_text)
        if inspect.isawaitable(out):
            out = await out
        return self._value(out)


_VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")


def load_reward(spec: str) -> Reward:
    """``module:function`` -> `Reward`; `DataError` names a malformed spec, an import failure or a bad signature."""
    fn = load_path(spec, "data.reward", DataError, want_callable=True)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return Reward(spec, fn, verl_style=False)
    names = [p for p, v in params.items() if v.kind in (v.POSITIONAL_ONLY, v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)]
    if all(p in params for p in _VERL_PARAMS) or any(v.kind == v.VAR_KEYWORD for v in params.values()):
        return Reward(spec, fn, verl_style=True)
    required = [p for p, v in params.items() if v.default is v.empty and v.kind in (v.POSITIONAL_ONLY,
                                                                                      v.POSITIONAL_OR_KEYWORD)]
    if len(required) <= 2 <= len(names) or any(v.kind == v.VAR_POSITIONAL for v in params.values()):
        return Reward(spec, fn, verl_style=False)
    raise DataError(f"reward {spec} takes ({', '.join(names)}); it must take (data_source, solution_str, "
                    "ground_truth, extra_info) like verl's compute_score, or (prompt, response)")


def decode_response(tokenizer, response_ids: np.ndarray) -> str:
    """Response text up to (not including) the first EOS, special tokens dropped."""
    ids = [int(t) for t in response_ids]
    eos = tokenizer.eos_token_id
    if eos in ids:
        ids = ids[: ids.index(eos)]
    return tokenizer.decode(ids, skip_special_tokens=True)


def check_model_dir(path: str) -> None:
    """A local HF model directory: fail naming ``path`` when it is not one."""
    p = Path(path)
    if not p.is_dir():
        raise DataError(f"model.path {path}: no such directory (give a local Hugging Face model directory)")
    if not (p / "config.json").is_file():
        raise DataError(f"model.path {path}: not a model directory (no config.json)")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise DataError(f"model.path {path}: no weights (*.safetensors or *.bin)")
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise DataError(f"model.path {path}: no tokenizer (tokenizer.json or tokenizer_config.json)")
