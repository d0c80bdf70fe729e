"""The default policy: the tiny model, warm-started on the built-in addition task.

``default_model_path()`` returns a local HF model directory. At first use it builds the tiny
model (`asyncrl.models.tiny`) and runs a short supervised phase (about a minute on one CPU
core), then caches the result under ``$ASYNCRL_CACHE`` or ``~/.cache/asyncrl/``, keyed by a
hash of the model config, the task config and these settings; later calls return at once.

The supervised phase is deliberately *noisy*: a fraction ``noise`` of its target answers is
replaced by a near miss (the sum off by 1, 2 or 10). The model learns the task's format and
mostly the right digits but, sampled at temperature 1, answers correctly only part of the
time (about 30%; greedy decoding about 80%), and its groups of samples have mixed rewards.
That leaves RL a signal it can climb quickly on a CPU: move probability mass onto the
answer the model already ranks first. The measured rewards are written to
``warm_start.json`` in the model directory.

Left out: shipping a checkpoint (a few hundred KB, but a built artifact is easier to keep in
step with ``TINY_CONFIG``), and any dataset other than the built-in task.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from asyncrl.models.tiny import TINY_CONFIG, build_tiny_model, build_tokenizer
from asyncrl.tasks.arithmetic import (
    ArithmeticTaskConfig,
    decode_response,
    encode_prompt,
    generate_dataset,
    make_problem,
    reward,
)

#: Bump when the recipe below changes in a way the settings do not capture.
RECIPE_VERSION = 1
_NEAR_MISSES = (-10, -2, -1, 1, 2, 10)


@dataclass(kw_only=True)
class WarmStartConfig:
    """Settings of the short supervised phase."""

    steps: int = 1000
    """Optimizer steps (about 50 ms each on one CPU core)."""
    batch_size: int = 128
    """Problems per step."""
    lr: float = 1e-2
    """AdamW learning rate (constant)."""
    noise: float = 0.5
    """Fraction of supervised answers replaced by a near miss; sets how wrong the model stays."""
    seed: int = 0
    """Seed of the initial weights and of the supervised problems."""
    lock_timeout_s: float = 900.0
    """How long to wait for another process that is building the same cached model."""

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0 <= self.noise < 1:
            raise ValueError(f"noise must be in [0, 1), got {self.noise}")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$ASYNCRL_CACHE``, else ``~/.cache/asyncrl``."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("ASYNCRL_CACHE") or Path.home() / ".cache" / "asyncrl")


def cache_key(config: WarmStartConfig, task: ArithmeticTaskConfig) -> str:
    settings = {k: v for k, v in asdict(config).items() if k != "lock_timeout_s"}
    blob = json.dumps(
        {"model": TINY_CONFIG, "task": asdict(task), "warm": settings, "recipe": RECIPE_VERSION}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_model_path(
    cache_dir: str | os.PathLike | None = None,
    *,
    config: WarmStartConfig | None = None,
    task: ArithmeticTaskConfig | None = None,
) -> Path:
    """The warm-started tiny model's directory, built and cached at first use."""
    config = config or WarmStartConfig()
    task = task or ArithmeticTaskConfig()
    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"tiny-arith-{cache_key(config, task)}"
    if (final / "warm_start.json").exists():
        return final
    with _file_lock(root / f"{final.name}.lock", config.lock_timeout_s):
        if (final / "warm_start.json").exists():  # another process built it meanwhile
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        try:
            warm_start(tmp, config=config, task=task)
            if final.exists():  # a partial directory left by a crash before the rename
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float):
    # flock has no timeout of its own: try without blocking until the deadline.
    deadline = time.monotonic() + timeout_s
    with open(path, "w") as fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process holds {path} (building the warm-start model) for longer than "
                        f"lock_timeout_s={timeout_s}"
                    ) from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def warm_start(path: str | os.PathLike, *, config: WarmStartConfig, task: ArithmeticTaskConfig) -> Path:
    """Build the tiny model in ``path``, run the noisy supervised phase, save it and its rewards."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    build_tiny_model(path, seed=config.seed)
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    rng = np.random.default_rng(config.seed)
    started = time.monotonic()
    for _ in range(config.steps):
        ids, target_mask = _sft_batch(tok, task, config, rng)
        logp = torch.log_softmax(model(ids).logits[:, :-1].float(), -1)
        token_logp = logp.gather(2, ids[:, 1:, None])[..., 0]
        mask = target_mask[:, 1:]
        # Loss on the answer and its EOS only: the prompt is given, not learned.
        loss = -(token_logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(path)
    rows = generate_dataset(256, seed=10_000 + config.seed, config=task)
    info = {
        "cache_key": cache_key(config, task),
        "settings": asdict(config),
        "task": asdict(task),
        "train_seconds": round(time.monotonic() - started, 1),
        "greedy_reward": evaluate_reward(model, tok, rows, task, temperature=None),
        "sampled_reward_t1": evaluate_reward(model, tok, rows, task, temperature=1.0),
    }
    (path / "warm_start.json").write_text(json.dumps(info, indent=2))
    return path


def _sft_batch(tok, task: ArithmeticTaskConfig, config: WarmStartConfig, rng: np.random.Generator):
    import torch

    seqs, masks = [], []
    for _ in range(config.batch_size):
        prompt, answer = make_problem(rng, task)
        if rng.random() < config.noise:
            answer = str(abs(int(answer) + int(rng.choice(_NEAR_MISSES))))
        p = encode_prompt(tok, prompt).tolist()
        a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(p + a)
        masks.append([0.0] * len(p) + [1.0] * len(a))
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([m + [0.0] * (width - len(m)) for m in masks])
    return ids, mask


def evaluate_reward(model, tok, rows: list[dict], task: ArithmeticTaskConfig, temperature: float | None, seed=0):
    """Mean task reward of ``model`` on ``rows``: greedy (``temperature=None``) or sampled."""
    import torch

    prompts = [encode_prompt(tok, r["prompt"]) for r in rows]
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        by_len[len(p)].append(i)
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    with torch.no_grad():
        for n, idx in by_len.items():  # equal lengths: no padding needed
            out = torch.as_tensor(np.stack([prompts[i] for i in idx]))
            for _ in range(task.max_response_tokens):
                logits = model(out).logits[:, -1].float()
                if temperature is None:
                    nxt = logits.argmax(-1)
                else:
                    nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
                out = torch.cat([out, nxt[:, None]], 1)
            for j, i in enumerate(idx):
                total += reward(rows[i]["prompt"], decode_response(tok, out[j, n:].tolist()))
    return total / len(rows)
