"""Store configuration: frozen, validated dataclasses loadable from TOML or a dict.

Every section has its own dataclass; :class:`StoreConfig` nests them. Unknown keys and
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
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vecstore.config_parse import check_fields, layers_from, reject_unknown, section_from
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

_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")

_FIXED_FOR_STORE = ("index.kind", "index.tokens_per_cluster", "index.segment_tokens",
                    "index.kmeans_iters", "index.page_tokens", "attention.sink_tokens",
                    "attention.update_tokens", "cluster.seed")


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexConfig:
    """How each layer's indexed tokens are organised.

    Attributes
    ----------
    kind : str
        Index implementation: ``wave`` (clustered, the method), ``flat`` (exact),
        ``quest`` (page min/max bounds), ``sink_window`` (recency only) or
        ``topk_oracle`` (exact top-k tokens, the ceiling of retrieval-only methods).
    tokens_per_cluster : int
        Average tokens per k-means cluster (16: small enough that a retrieved cluster
        wastes few reads, large enough that centroid scoring is 16x cheaper than keys).
    segment_tokens : int
        Tokens clustered together as one segment (8192: keeps k-means cheap and local
        in position, which RoPE makes meaningful).
    kmeans_iters : int
        Spherical k-means iterations per segment (10, as in the reference).
    page_tokens : int
        Page size of the ``quest`` and ``sink_window`` indexes (16, Quest's default).
    radius_weight : float
        Weight ``w`` of a cluster's radius ``r`` in the ``wave`` ranking logit
        ``q·c + w·|q|·r`` (0.5). At 1.0 the logit is the upper bound of the best member's
        score, which finds clusters holding one sought outlying key but favours wide
        clusters that carry little mass; 0.0 is the centroid score alone, as in
        RetroInfer. Only ranking changes; estimation uses the centroid. A query-time
        setting: a persisted store may be reopened with another value.
    """

    kind: str = "wave"
    tokens_per_cluster: int = 16
    segment_tokens: int = 8192
    kmeans_iters: int = 10
    page_tokens: int = 16
    radius_weight: float = 0.5

    def __post_init__(self) -> None:
        check_fields(self, "index")
        _check(self.tokens_per_cluster >= 1, "index.tokens_per_cluster", "must be >= 1")
        _check(self.segment_tokens >= self.tokens_per_cluster, "index.segment_tokens",
               f"must be >= tokens_per_cluster ({self.tokens_per_cluster})")
        _check(self.kmeans_iters >= 0, "index.kmeans_iters", "must be >= 0")
        _check(self.page_tokens >= 1, "index.page_tokens", "must be >= 1")
        _check(math.isfinite(self.radius_weight) and self.radius_weight >= 0,
               "index.radius_weight", f"must be a finite number >= 0, got {self.radius_weight}")


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionConfig:
    """The three zones of tripartite attention and their budgets.

    Attributes
    ----------
    sink_tokens : int
        First tokens of a sequence always attended exactly (4: attention sinks).
    window_tokens : int
        Most recent tokens always attended exactly (64).
    retrieval_budget : float
        Fraction of index units (clusters, pages or tokens) fetched exactly per query
        (0.018, the reference's default).
    estimation_budget : float
        Fraction of units, ranked after the retrieved ones, approximated from their
        centroids and value sums (0.232 … 1.0; 1.0 estimates every unit, costing only
        the value-sum reads since all centroids are scored anyway). Units beyond it are
        dropped. Only indexes with centroids (``wave``) estimate.
    update_tokens : int
        Decode tokens kept in the steady zone before they are clustered into a new
        segment (1024).
    """

    sink_tokens: int = 4
    window_tokens: int = 64
    retrieval_budget: float = 0.018
    estimation_budget: float = 0.232
    update_tokens: int = 1024

    def __post_init__(self) -> None:
        check_fields(self, "attention")
        _check(self.sink_tokens >= 0, "attention.sink_tokens", "must be >= 0")
        _check(self.window_tokens >= 0, "attention.window_tokens", "must be >= 0")
        _check(0.0 < self.retrieval_budget <= 1.0, "attention.retrieval_budget",
               f"must be in (0, 1], got {self.retrieval_budget}")
        _check(0.0 <= self.estimation_budget <= 1.0, "attention.estimation_budget",
               f"must be in [0, 1], got {self.estimation_budget}")
        _check(self.update_tokens >= 1, "attention.update_tokens", "must be >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterConfig:
    """Which k-means backend builds the wave index.

    Attributes
    ----------
    kind : str
        ``torch`` (CPU and CUDA, default), ``faiss`` (faiss-cpu, or faiss-gpu when
        installed) or ``cupy`` (CUDA).
    seed : int
        Seed for any randomness in a backend; the strided initialisation itself is
        deterministic.
    """

    kind: str = "torch"
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, "cluster")


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    """The GPU block cache in front of offloaded KV.

    Attributes
    ----------
    policy : str
        Replacement policy: ``lru`` (default), ``fifo``, ``lfu``, ``clock`` and others
        registered in :data:`vecstore.cache.POLICIES`.
    capacity : float
        Cache size as a fraction of a layer's clusters (0.05, the reference's default).
    """

    policy: str = "lru"
    capacity: float = 0.05

    def __post_init__(self) -> None:
        check_fields(self, "cache")
        _check(0.0 < self.capacity <= 1.0, "cache.capacity",
               f"must be in (0, 1], got {self.capacity}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutorConfig:
    """How a query plan is computed.

    Attributes
    ----------
    kind : str
        ``auto`` (default): the fused ``wave`` executor when ``device`` is CUDA and Triton
        is installed, the ``torch`` reference otherwise. ``torch`` (the reference, CPU and
        CUDA), ``wave``, or another registered executor: an explicit choice is kept.
    device : str
        Device the executor computes on: ``cpu``, ``cuda`` or ``cuda:N``.
    buffer_factor : float
        Read by no executor at present, kept so that stores which recorded it reopen: the
        wave executor sizes its execution buffer to the ``k1`` largest clusters of a row, so
        every step fits.
    """

    kind: str = "auto"
    device: str = "cpu"
    buffer_factor: float = 4.0

    def __post_init__(self) -> None:
        check_fields(self, "executor")
        _check(self.buffer_factor >= 1.0, "executor.buffer_factor", "must be >= 1")
        _check(_DEVICE.fullmatch(self.device) is not None, "executor.device",
               f"must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class KVStoreConfig:
    """Where the indexed KV rows live.

    Attributes
    ----------
    kind : str
        A tier registered in :data:`vecstore.kvstore.KVSTORES` (checked when a store
        opens): ``memory`` (each layer's indexed rows on its device) or ``pinned`` (in
        pinned host memory, fetched through the block cache). Index metadata and the
        steady zone stay on the layer's device either way.
    pinned_budget_gb : float
        Upper bound on the memory of an offload tier (``pinned``); 0 means unbounded.
    gpu_budget_gb : float
        Upper bound, per device, on the memory of a resident tier (``memory``), the index
        metadata, and the wave buffers' block caches and execution buffers; 0 means
        unbounded.
    """

    kind: str = "memory"
    pinned_budget_gb: float = 0.0
    gpu_budget_gb: float = 0.0

    def __post_init__(self) -> None:
        check_fields(self, "kvstore")
        _check(self.pinned_budget_gb >= 0, "kvstore.pinned_budget_gb", "must be >= 0")
        _check(self.gpu_budget_gb >= 0, "kvstore.gpu_budget_gb", "must be >= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerOverride:
    """Per-layer changes to the store-wide settings.

    Attributes
    ----------
    exact : bool
        Keep this layer exact: every token is attended (early layers often attend
        diffusely).
    retrieval_budget : float | None
        This layer's retrieval budget, or ``None`` for the store-wide one.
    estimation_budget : float | None
        This layer's estimation budget, or ``None`` for the store-wide one.
    """

    exact: bool = False
    retrieval_budget: float | None = None
    estimation_budget: float | None = None

    def __post_init__(self) -> None:
        check_fields(self, "layers.*")
        if self.retrieval_budget is not None:
            _check(0.0 < self.retrieval_budget <= 1.0, "layers.*.retrieval_budget",
                   f"must be in (0, 1], got {self.retrieval_budget}")
        if self.estimation_budget is not None:
            _check(0.0 <= self.estimation_budget <= 1.0, "layers.*.estimation_budget",
                   f"must be in [0, 1], got {self.estimation_budget}")


@dataclass(frozen=True, slots=True)
class LayerConfig:
    """The effective settings of one layer (store-wide values with overrides applied)."""

    exact: bool
    retrieval_budget: float
    estimation_budget: float


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
            _check(isinstance(value, cls), name,
                   f"expected an instance of {cls.__name__}, got {type(value).__name__} "
                   "(StoreConfig.from_dict builds one from nested mappings)")
        _check(isinstance(self.layers, dict), "layers",
               f"expected a dict of LayerOverride, got {type(self.layers).__name__}")
        for layer, override in self.layers.items():
            _check(isinstance(layer, int) and not isinstance(layer, bool) and layer >= 0,
                   f"layers.{layer}", "layer keys must be non-negative integers")
            _check(isinstance(override, LayerOverride), f"layers.{layer}",
                   f"expected a LayerOverride, got {type(override).__name__}")

    def for_layer(self, layer: int) -> LayerConfig:
        """Effective settings of ``layer``."""
        o = self.layers.get(layer, LayerOverride())
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
