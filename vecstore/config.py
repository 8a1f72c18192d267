"""Store configuration: frozen, validated dataclasses loadable from TOML or a dict.

Every section has its own dataclass (:mod:`vecstore.config_sections`, importable from
here too); :class:`StoreConfig` nests them. Unknown keys and
out-of-range values raise :class:`~vecstore.errors.ConfigError` naming the dotted key.

Examples
--------
>>> cfg = StoreConfig.from_dict({"attention": {"retrieval_budget": 0.05}})
>>> cfg.attention.retrieval_budget
0.05
>>> StoreConfig.from_dict(cfg.to_dict()) == cfg
True
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vecstore.config_parse import layers_from, reject_unknown, require, section_from
from vecstore.config_sections import AttentionConfig as AttentionConfig
from vecstore.config_sections import CacheConfig as CacheConfig
from vecstore.config_sections import ClusterConfig as ClusterConfig
from vecstore.config_sections import ExecutorConfig as ExecutorConfig
from vecstore.config_sections import IndexConfig as IndexConfig
from vecstore.config_sections import KVStoreConfig as KVStoreConfig
from vecstore.config_sections import LayerConfig as LayerConfig
from vecstore.config_sections import LayerOverride as LayerOverride
from vecstore.errors import ConfigError

__all__ = [
    "IndexConfig",
    "AttentionConfig",
    "ClusterConfig",
    "CacheConfig",
    "ExecutorConfig",
    "KVStoreConfig",
    "LayerOverride",
    "LayerConfig",
    "StoreConfig",
    "load_config",
]

_FIXED_FOR_STORE = ("index.kind", "index.tokens_per_cluster", "index.segment_tokens",
                    "index.kmeans_iters", "index.page_tokens", "attention.sink_tokens",
                    "attention.update_tokens", "cluster.seed")


_NO_OVERRIDE = LayerOverride()  # built (and checked) once: for_layer runs on every query


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """Every setting of a store.

    Attributes
    ----------
    index : IndexConfig
        Index kind and clustering granularity.
    attention : AttentionConfig
        Zones and budgets.
    cluster : ClusterConfig
        k-means backend.
    cache : CacheConfig
        Block cache policy and size.
    executor : ExecutorConfig
        Executor kind and device.
    kvstore : KVStoreConfig
        KV placement and memory budgets.
    layers : dict[int, LayerOverride]
        Per-layer overrides, keyed by layer index.
    """

    index: IndexConfig = field(default_factory=IndexConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    kvstore: KVStoreConfig = field(default_factory=KVStoreConfig)
    layers: dict[int, LayerOverride] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            require(isinstance(value, cls), name,
                   f"expected an instance of {cls.__name__}, got {type(value).__name__} "
                   "(StoreConfig.from_dict builds one from nested mappings)")
        require(isinstance(self.layers, dict), "layers",
               f"expected a dict of LayerOverride, got {type(self.layers).__name__}")
        for layer, override in self.layers.items():
            require(isinstance(layer, int) and not isinstance(layer, bool) and layer >= 0,
                   f"layers.{layer}", "layer keys must be non-negative integers")
            require(isinstance(override, LayerOverride), f"layers.{layer}",
                   f"expected a LayerOverride, got {type(override).__name__}")

    def for_layer(self, layer: int) -> LayerConfig:
        """Effective settings of ``layer``."""
        o = self.layers.get(layer, _NO_OVERRIDE)
        a = self.attention
        return LayerConfig(
            exact=o.exact,
            retrieval_budget=(a.retrieval_budget if o.retrieval_budget is None
                              else o.retrieval_budget),
            estimation_budget=(a.estimation_budget if o.estimation_budget is None
                               else o.estimation_budget),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (layer keys as strings, as TOML needs)."""
        d = {f.name: dataclasses.asdict(getattr(self, f.name))
             for f in dataclasses.fields(self) if f.name != "layers"}
        d["layers"] = {str(k): dataclasses.asdict(v) for k, v in sorted(self.layers.items())}
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StoreConfig:
        """Build from a (possibly partial) nested mapping, validating every key."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"config: expected a mapping, got {type(data).__name__}")
        sections = {f.name: f for f in dataclasses.fields(cls)}
        reject_unknown(data, sections, "")
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            if name == "layers":
                kwargs["layers"] = layers_from(value, LayerOverride)
            else:
                kwargs[name] = section_from(_SECTIONS[name], value, name)
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path) -> StoreConfig:
        """Load from a TOML file."""
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise ConfigError(f"config file {str(path)!r}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r}: not UTF-8 text, as TOML must be "
                              f"({exc.reason} at byte {exc.start})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r}: {exc}") from None
        return cls.from_dict(data)

    def conflicts_with(self, stored: StoreConfig) -> list[str]:
        """Keys whose values differ from ``stored`` and cannot change for an existing store."""
        mine, theirs = self.to_dict(), stored.to_dict()
        out = []
        for key in _FIXED_FOR_STORE:
            sec, name = key.split(".")
            if mine[sec][name] != theirs[sec][name]:
                out.append(f"{key} (stored {theirs[sec][name]!r}, given {mine[sec][name]!r})")
        return out


_SECTIONS: dict[str, type] = {
    "index": IndexConfig,
    "attention": AttentionConfig,
    "cluster": ClusterConfig,
    "cache": CacheConfig,
    "executor": ExecutorConfig,
    "kvstore": KVStoreConfig,
}


def load_config(config: StoreConfig | Mapping[str, Any] | str | Path | None) -> StoreConfig:
    """Accept a :class:`StoreConfig`, a mapping, a TOML path or ``None`` (defaults)."""
    if config is None:
        return StoreConfig()
    if isinstance(config, StoreConfig):
        return config
    if isinstance(config, (str, Path)):
        return StoreConfig.from_toml(config)
    if isinstance(config, Mapping):
        return StoreConfig.from_dict(config)
    raise ConfigError(f"config: expected StoreConfig, dict, TOML path or None, "
                      f"got {type(config).__name__}")
