"""Turning nested mappings (parsed TOML, dicts) into validated config dataclasses."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from vecstore.errors import ConfigError

__all__ = ["reject_unknown", "require", "coerce", "check_fields", "section_from", "layers_from"]

T = TypeVar("T")


def require(cond: bool, key: str, msg: str) -> None:
    """Raise :class:`ConfigError` ``"{key}: {msg}"`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def reject_unknown(data: Mapping[str, Any], known: Mapping[str, Any], prefix: str) -> None:
    """Raise :class:`ConfigError` for a key of ``data`` not in ``known``, naming the closest."""
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check ``value`` against a field's annotation (bool, int, float, str, optional)."""
    origin = typing.get_origin(annotation)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        return coerce(value, args[0], key)
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(obj: Any, section: str) -> None:
    """Check every field of the config dataclass ``obj`` against its annotation, naming
    keys ``section.field`` (so one built directly gets the checks of a parsed one); an
    int given for a float field becomes a float."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        checked = coerce(value, hints[f.name], f"{section}.{f.name}")
        if checked is not value:
            object.__setattr__(obj, f.name, checked)


def section_from(cls: type, value: Any, prefix: str) -> Any:
    """Build the dataclass ``cls`` from a mapping, naming keys as ``prefix.key``."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"{prefix}: expected a table of settings, got {value!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    reject_unknown(value, fields, f"{prefix}.")
    hints = typing.get_type_hints(cls)
    kwargs = {k: coerce(v, hints[k], f"{prefix}.{k}") for k, v in value.items()}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        msg = str(exc)
        raise ConfigError(msg.replace("layers.*", prefix) if prefix.startswith("layers")
                          else msg) from None


def layers_from(value: Any, override: type[T]) -> dict[int, T]:
    """Per-layer overrides from a table keyed by layer index (strings, as in TOML)."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"layers: expected a table keyed by layer index, got {value!r}")
    out: dict[int, T] = {}
    for key, entry in value.items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            raise ConfigError(f"layers.{key}: layer keys must be integers") from None
        if layer < 0:
            raise ConfigError(f"layers.{key}: layer keys must be >= 0")
        out[layer] = section_from(override, entry, f"layers.{key}")
    return out
