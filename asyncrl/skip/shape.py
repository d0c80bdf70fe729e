"""What makes a rollout reusable: the shape key's fields, built from what a run already knows.

A dump is loaded only by a run whose shape is equal field for field, so a field belongs here
when changing it changes what generation would produce: the model, the prompts in feed order,
the reward, ``n``, the token budget and the sampling settings (seed included).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def model_fingerprint(path: str | os.PathLike) -> str:
    """``<resolved dir>@<12 hex>``: the hash covers every file's name, size and modification time
    (a model rewritten in place gets a new fingerprint; hashing GBs of weights would not pay)."""
    root = Path(path).resolve()
    h = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root) if root.is_dir() else p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"{root}@{h.hexdigest()[:12]}"


def prompts_fingerprint(prompt_ids: Iterable[Any], source: str) -> str:
    """``<source>@<12 hex>`` over the encoded prompts in feed order."""
    h = hashlib.sha256()
    count = 0
    for ids in prompt_ids:
        b = memoryview(ids).tobytes() if not hasattr(ids, "tobytes") else ids.tobytes()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
        count += 1
    return f"{source}[{count}]@{h.hexdigest()[:12]}"


def rollout_shape(cfg: Any, *, model: str, data: str, reward: str, **extra: Any) -> dict:
    """The shape of a Rollouter's groups: ``cfg`` is its `RolloutConfig`; ``model`` and ``data``
    are fingerprints (see above); ``reward`` names the reward function; ``extra`` adds fields
    (the synchronous path adds ``groups_per_step``)."""
    return {
        "model": model, "data": data, "reward": reward, "n": cfg.n, "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k, "seed": cfg.seed, **extra,
    }
