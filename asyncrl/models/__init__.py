"""The tiny default model (`asyncrl.models.tiny`), shipped warm-started (`asyncrl.models.warm_start`).

The demo's starting policy is a checkpoint inside this package (``asyncrl/models/tiny_arith/``:
HF config, safetensors weights, tokenizer files and ``warm_start.json`` with the rewards it was
measured at), so every machine starts from the same weights. ``scripts/make_default_model.py``
rebuilds it with the warm-start recipe.
"""

from __future__ import annotations

from pathlib import Path

#: The shipped warm-started model: a local Hugging Face model directory (package data).
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "tiny_arith"


def default_model_path() -> Path:
    """The shipped warm-started tiny model's directory (nothing is trained or downloaded)."""
    missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json", "warm_start.json")
               if not (DEFAULT_MODEL_DIR / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the default model in {DEFAULT_MODEL_DIR} lacks {', '.join(missing)}: the package was installed "
            "without its data; reinstall it, or rebuild the model with `python scripts/make_default_model.py`"
        )
    return DEFAULT_MODEL_DIR


__all__ = ["DEFAULT_MODEL_DIR", "default_model_path"]
