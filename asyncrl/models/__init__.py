"""The tiny models (`asyncrl.models.tiny`, the chat one `asyncrl.models.tiny_chat`), how a model
directory's tokenizer loads, and the default models, shipped warm-started (their recipes are
`asyncrl.demos.warm_start` and `asyncrl.demos.calculator`: they import the tasks, the agent loop
and the engines, so they live above the library, not here).

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
#: The calculator task's shipped model (`asyncrl.demos.calculator`).
CALCULATOR_MODEL_DIR = Path(__file__).resolve().parent / "tiny_calc"
_SHIPPED = {"arithmetic": (DEFAULT_MODEL_DIR, "scripts/make_default_model.py"),
            "calculator": (CALCULATOR_MODEL_DIR, "scripts/make_calculator_model.py")}
"""Each built-in task's model directory and the script that rebuilds it."""


def default_model_path(task: str = "arithmetic") -> Path:
    """The shipped warm-started tiny model's directory of a built-in task (nothing is trained or
    downloaded): the addition demo's, or the calculator task's (`asyncrl.demos.calculator`)."""
    if task not in _SHIPPED:
        raise ValueError(f"no built-in task {task!r} ({', '.join(_SHIPPED)})")
    path, script = _SHIPPED[task]
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json", "warm_start.json")
               if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the {task} task's model in {path} lacks {', '.join(missing)}: the package was installed "
            f"without its data; reinstall it, or rebuild the model with `python {script}`"
        )
    return path


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


__all__ = ["CALCULATOR_MODEL_DIR", "DEFAULT_MODEL_DIR", "default_model_path", "load_tokenizer"]
