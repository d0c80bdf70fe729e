"""Which class implements each half of each weight-sync backend: the one place a backend is chosen.

`base` is only the interface and the backends import it; this registry imports the backends
(lazily, by name) and nothing imports it back. A receiver depends on the method and on the
engine's kind: a vLLM engine's model lives in vLLM's worker processes, so its ``broadcast``
receiver drives a receiver inside them (`asyncrl.sync.vllm_broadcast`).
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.importpath import load_path
from asyncrl.sync.base import ReceiverInit, SenderInit, WeightReceiver, WeightSender
from asyncrl.sync.config import SYNC_METHODS

SENDERS = {
    "broadcast": "asyncrl.sync.broadcast:BroadcastSender",
    "vllm": "asyncrl.sync.vllm:VLLMWeightSender",
}
"""Trainer half per method."""

RECEIVERS = {
    ("torch", "broadcast"): "asyncrl.sync.broadcast:BroadcastReceiver",
    ("vllm", "broadcast"): "asyncrl.sync.vllm_broadcast:VLLMBroadcastReceiver",
    ("vllm", "vllm"): "asyncrl.sync.vllm:VLLMWeightReceiver",
}
"""Engine half per (engine kind, method)."""


def _load(path: str):
    return load_path(path, "weight_sync.method", ImportError)


def make_sender(model: torch.nn.Module, *, rank: int, init: SenderInit) -> WeightSender:
    """The trainer half of ``init.method`` (imported only when asked for)."""
    if init.method not in SENDERS:
        raise ValueError(f"weight-sync method must be one of {SYNC_METHODS}, got {init.method!r}")
    return _load(SENDERS[init.method]).from_init(model, rank=rank, init=init)


def make_receiver(engine: Any, init: ReceiverInit, *, engine_kind: str) -> WeightReceiver:
    """The engine half of ``init.method`` for ``engine`` of kind ``engine_kind``."""
    key = (engine_kind, init.method)
    if key not in RECEIVERS:
        methods = sorted(m for k, m in RECEIVERS if k == engine_kind)
        raise ValueError(f"a {engine_kind!r} engine receives weights with method {' or '.join(map(repr, methods))}, "
                         f"not {init.method!r}: set WeightSyncConfig.method={methods[0]!r}" if methods else
                         f"no weight-sync receiver for engine kind {engine_kind!r}")
    return _load(RECEIVERS[key]).from_init(engine, init)
