"""The tiny default model (`asyncrl.models.tiny`) and its warm start (`asyncrl.models.warm_start`)."""

from __future__ import annotations

import os
from pathlib import Path


def default_model_path(cache_dir: str | os.PathLike | None = None, **kwargs) -> Path:
    """The warm-started tiny model's directory, built at first use and cached (see warm_start)."""
    from asyncrl.models.warm_start import default_model_path as build

    return build(cache_dir, **kwargs)


__all__ = ["default_model_path"]
