"""The tiny default model (`asyncrl.models.tiny`), shipped warm-started (`asyncrl.models.warm_start`).

The demo's starting policy is a checkpoint inside this package (``asyncrl/models/tiny_arith/``:
HF config, safetensors weights, tokenizer files and ``warm_start.json`` with the rewards it was
measured at), so every machine starts from the same weights. ``scripts/make_default_model.py``
rebuilds it with the warm-start recipe.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The shipped warm-started model: a local Hugging Face model directory (package data).
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "tiny_arith"


def default_model_path(task: str = "arithmetic") -> Path:
    """The shipped warm-started tiny model's directory of a built-in task (nothing is trained or
    downloaded): the addition demo's, or the calculator task's (`asyncrl.models.calculator`)."""
    if task == "calculator":
        from asyncrl.models.calculator import calculator_model_path

        return calculator_model_path()
    if task != "arithmetic":
        raise ValueError(f"no built-in task {task!r} (arithmetic, calculator)")
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json", "warm_start.json")
               if not (DEFAULT_MODEL_DIR / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the default model in {DEFAULT_MODEL_DIR} lacks {', '.join(missing)}: the package was installed "
            "without its data; reinstall it, or rebuild the model with `python scripts/make_default_model.py`"
        )
    return DEFAULT_MODEL_DIR


_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a model directory, as its checkpoint declares it.

    ``AutoTokenizer``, except where ``tokenizer_config.json`` declares the generic fast tokenizer
    (``TokenizersBackend`` / ``PreTrainedTokenizerFast``) over a ``tokenizer.json``: transformers 5
    then builds the model type's own class instead (``Qwen2Tokenizer`` for a qwen2 model), whose
    pre-tokenizer need not be the saved one's (the tiny chat tokenizer lost every space that way).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    config = path / "tokenizer_config.json"
    if config.is_file() and (path / "tokenizer.json").is_file():
        try:
            declared = json.loads(config.read_text()).get("tokenizer_class")
        except (OSError, ValueError):
            declared = None
        if declared in _GENERIC_TOKENIZERS:
            return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


__all__ = ["DEFAULT_MODEL_DIR", "default_model_path", "load_tokenizer"]
