"""`load_config`: schema defaults < derived values < presets < YAML files < dotted overrides.

OmegaConf does the merging: the dataclasses are the schema, a YAML file and dotted overrides
merge into it with type coercion, and an unknown key or a value of the wrong type is an error
naming its dotted path (and the launcher flag, when one sets it).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from asyncrl.config.derived import COMPUTED, DERIVED
from asyncrl.config.errors import ConfigError
from asyncrl.config.flags import named
from asyncrl.config.presets import presets_for
from asyncrl.config.root import RunConfig, check

MOVED_KEYS = {"skip.rollout": "the rollout role caches a train step's batch in your own loop "
                              "(SkipManager.set_step); a run's Rollouter generates per sample: use "
                              "skip.async_rollout (its steps are feed indices of sample_{epoch}_{index})"}
"""Keys a user may expect in a run's config that are not (or no longer) there: what to use instead."""


def load_config(yaml_files: list[str] = (), overrides: list[str] = ()) -> tuple[RunConfig, DictConfig]:
    """Schema defaults < derived values < presets < YAML files (in order) < overrides.

    Returns the typed `RunConfig` and the resolved `DictConfig` (what ``config.yaml`` holds).
    Raises `ConfigError` (one line, naming the dotted path) for anything that cannot run.
    """
    layers = [_read_yaml(p) for p in yaml_files] + [_dotlist(overrides)]
    computed = _take_computed(layers)
    base = OmegaConf.structured(RunConfig)
    for key, expr in DERIVED.items():
        OmegaConf.update(base, key, expr, merge=False)
    try:
        user = OmegaConf.merge(base, *layers)
        given = OmegaConf.merge(*layers) if layers else OmegaConf.create()
        preset = OmegaConf.create()
        for key, value in presets_for(user).items():
            OmegaConf.update(preset, key, value)
        merged = OmegaConf.merge(base, preset, *layers)
        OmegaConf.resolve(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e)) from None
    cfg = _instantiate(merged)
    for key, value in computed.items():
        follows, why = COMPUTED[key](cfg)
        if value != follows:
            raise ConfigError(f"{key}={value} contradicts {why} ({key} is not a setting: remove it)")
    check(cfg, given)
    return cfg, merged


def _take_computed(layers: list[DictConfig]) -> dict[str, Any]:
    """Remove the `COMPUTED` keys from the layers (they are not in the schema); the last value given of each."""
    taken = {}
    for layer in layers:
        for key in COMPUTED:
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(layer, parent, default=None)
            if isinstance(node, DictConfig) and leaf in node:
                taken[key] = node.pop(leaf)
    return taken


def to_yaml(resolved: DictConfig) -> str:
    return OmegaConf.to_yaml(resolved)


def _read_yaml(path: str) -> DictConfig:
    try:
        loaded = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except Exception as e:  # noqa: BLE001 - YAML syntax errors come in several types
        raise ConfigError(f"--config {path}: not valid YAML ({_first_line(str(e))})") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"--config {path}: the top level must be a mapping of sections, got a list")
    # A config.yaml printed before the run config lost its skip.rollout section holds it disabled:
    # it asked nothing, so such a run directory still resumes; an enabled one is refused below.
    old_role = OmegaConf.select(loaded, "skip.rollout", default=None)
    if isinstance(old_role, DictConfig) and not old_role.get("enable", False):
        loaded.skip.pop("rollout")
    return loaded


def _dotlist(overrides: list[str]) -> DictConfig:
    bad = [o for o in overrides if "=" not in o or not o.split("=", 1)[0].strip()]
    if bad:
        raise ConfigError(f"override {bad[0]!r} must look like key.path=value (e.g. trainer.optim.lr=1e-6)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e)) from None


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or ""
    msg = _first_line(getattr(e, "msg", None) or str(e))
    if "not in" in msg and key:
        why = next((f"; {reason}" for prefix, reason in MOVED_KEYS.items()
                    if key == prefix or key.startswith(prefix + ".")), "")
        return f"unknown key {named(key)}: {msg}{why}"
    return f"{named(key)}: {msg}" if key else msg


def _first_line(text: str) -> str:
    return " ".join(text.strip().splitlines()[:1]) or text


def _instantiate(node: DictConfig, path: str = "") -> Any:
    """Build the dataclasses bottom-up, so a `__post_init__` error is named by its section."""
    for key in node:
        child = node[key]
        if isinstance(child, DictConfig) and OmegaConf.get_type(child) not in (dict, None):
            _instantiate(child, f"{path}{key}.")
    try:
        return OmegaConf.to_object(node)
    except ValueError as e:
        section = path.rstrip(".") or "config"
        msg = _first_line(str(e))
        # Owners name their fields without the section (or as Class.field): give the dotted path.
        field_name = msg.split(" ", 1)[0].split(".")[-1]
        if field_name in node:
            key = f"{path}{field_name}"
            rest = msg.split(" ", 1)[1] if " " in msg else ""
            raise ConfigError(f"{named(key)} {rest}".strip()) from None
        raise ConfigError(f"{section}: {msg}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(_omegaconf_message(e)) from None
