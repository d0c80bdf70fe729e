"""``stream``: what the launcher decides of the sample stream, refused when a user sets it."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from asyncrl.config.errors import ConfigError
from asyncrl.queue.protocol import StreamConfig


def check_stream(s: StreamConfig, given: DictConfig | None) -> None:
    """The endpoint and the CURVE keys are the launcher's: a user's value is refused (a printed
    config.yaml's default endpoint is not)."""
    endpoint_given = given is not None and OmegaConf.select(given, "stream.endpoint", default=None) is not None
    if endpoint_given and s.endpoint != StreamConfig().endpoint:
        raise ConfigError("stream.endpoint is chosen by the launcher (the Trainer's node and a port bound there); "
                          "remove it")
    if s.curve is not None:
        raise ConfigError("stream.curve keys are made per run by the launcher (and never written down); remove them")
