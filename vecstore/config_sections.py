"""The sections of a store's configuration, one frozen, validated dataclass each, and the
effective settings of one layer. :class:`~vecstore.config.StoreConfig` nests them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from vecstore.config_parse import check_fields, require

__all__ = [
    "IndexConfig",
    "AttentionConfig",
    "ClusterConfig",
    "CacheConfig",
    "ExecutorConfig",
    "KVStoreConfig",
    "LayerOverride",
    "LayerConfig",
]

_DEVICE = re.compile(r"cpu|cuda(:[0-9]+)?")


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
        require(self.tokens_per_cluster >= 1, "index.tokens_per_cluster", "must be >= 1")
        require(self.segment_tokens >= self.tokens_per_cluster, "index.segment_tokens",
               f"must be >= tokens_per_cluster ({self.tokens_per_cluster})")
        require(self.kmeans_iters >= 0, "index.kmeans_iters", "must be >= 0")
        require(self.page_tokens >= 1, "index.page_tokens", "must be >= 1")
        require(math.isfinite(self.radius_weight) and self.radius_weight >= 0,
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
    prefill_group_gb : float
        Most GiB of keys and values a prefill chunk packs for one attention call over a
        group of rows' stored prefixes (4.0; a longer row is a group of its own): the
        prefill's scratch memory on the device (:mod:`attention.prefix`).
    prefill_mirror_gb : float | None
        Most GiB of device memory one :class:`attention.StoreAttention` keeps copies of its
        rows' stored prefixes in across a prompt's prefill chunks, for rows whose tier is
        not resident (``kvstore.kind = "pinned"``), so a chunk does not read its row's
        whole prefix from host memory again (:mod:`attention.prefix_mirror`); freed at the
        first decode step. A row that does not fit is read from its tier. 0.0: off.
        ``None`` (default): as much as the CUDA device has available, leaving free a
        quarter of what it had at the prompt's first chunk (off on a CPU).
    """

    sink_tokens: int = 4
    window_tokens: int = 64
    retrieval_budget: float = 0.018
    estimation_budget: float = 0.232
    update_tokens: int = 1024
    prefill_group_gb: float = 4.0
    prefill_mirror_gb: float | None = None

    def __post_init__(self) -> None:
        check_fields(self, "attention")
        require(self.sink_tokens >= 0, "attention.sink_tokens", "must be >= 0")
        require(self.window_tokens >= 0, "attention.window_tokens", "must be >= 0")
        require(0.0 < self.retrieval_budget <= 1.0, "attention.retrieval_budget",
               f"must be in (0, 1], got {self.retrieval_budget}")
        require(0.0 <= self.estimation_budget <= 1.0, "attention.estimation_budget",
               f"must be in [0, 1], got {self.estimation_budget}")
        require(self.update_tokens >= 1, "attention.update_tokens", "must be >= 1")
        require(self.prefill_group_gb >= 0, "attention.prefill_group_gb", "must be >= 0")
        require(self.prefill_mirror_gb is None or self.prefill_mirror_gb >= 0,
                "attention.prefill_mirror_gb", "must be >= 0")


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
        registered in :data:`vecstore.policies.POLICIES`.
    capacity : float
        Cache size as a fraction of a layer's clusters (0.05, the reference's default).
    """

    policy: str = "lru"
    capacity: float = 0.05

    def __post_init__(self) -> None:
        check_fields(self, "cache")
        require(0.0 < self.capacity <= 1.0, "cache.capacity",
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
        require(self.buffer_factor >= 1.0, "executor.buffer_factor", "must be >= 1")
        require(_DEVICE.fullmatch(self.device) is not None, "executor.device",
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
        require(self.pinned_budget_gb >= 0, "kvstore.pinned_budget_gb", "must be >= 0")
        require(self.gpu_budget_gb >= 0, "kvstore.gpu_budget_gb", "must be >= 0")


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
            require(0.0 < self.retrieval_budget <= 1.0, "layers.*.retrieval_budget",
                   f"must be in (0, 1], got {self.retrieval_budget}")
        if self.estimation_budget is not None:
            require(0.0 <= self.estimation_budget <= 1.0, "layers.*.estimation_budget",
                   f"must be in [0, 1], got {self.estimation_budget}")


@dataclass(frozen=True, slots=True)
class LayerConfig:
    """The effective settings of one layer (store-wide values with overrides applied)."""

    exact: bool
    retrieval_budget: float
    estimation_budget: float
