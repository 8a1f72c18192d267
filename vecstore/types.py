"""Result types returned by queries.

Shape letters used throughout vecstore:

- ``B``: sequences in a batch
- ``Hq``: query heads; ``Hkv``: KV heads; ``G = Hq // Hkv``: query heads per KV head
- ``L``: query tokens; ``T``: stored tokens; ``D``: head dimension
- ``C``: index units of a layer (clusters, pages or tokens); ``R``: retrieved units
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QueryStats", "QueryResult", "SearchResult"]


_STAT_FIELDS = ("tokens_total", "tokens_exact", "units_retrieved", "units_estimated",
                "estimated_mass")


class QueryStats:
    """What one query did, summed over its KV heads (and batch rows).

    Immutable; compares, hashes and prints like a dataclass of the five fields below. An
    executor that computes them on the device (the ``wave`` executor on CUDA) builds the
    stats with :meth:`deferred`, so a query never waits for the device to finish: the
    values are read back to the host (one transfer for all five) the first time any of
    them is read. :attr:`is_materialized` tells whether that has happened.

    Attributes
    ----------
    tokens_total : int
        Tokens stored in the queried sequences (per KV head, summed over rows).
    tokens_exact : int
        Tokens attended exactly (steady zone plus retrieved units), per KV head.
    units_retrieved : int
        Index units fetched exactly, summed over KV heads and rows.
    units_estimated : int
        Index units approximated by centroid and value sum, summed over KV heads and rows.
    estimated_mass : float
        Mean share of softmax mass carried by the estimation zone (0 when none).

    Examples
    --------
    >>> s = QueryStats.deferred(torch.tensor([100, 40, 3, 7, 0.25], dtype=torch.float64))
    >>> s.is_materialized
    False
    >>> s.tokens_exact, s.estimated_mass, s.is_materialized
    (40, 0.25, True)
    >>> s == QueryStats(100, 40, 3, 7, 0.25)
    True
    """

    __slots__ = ("_values", "_pending")

    def __init__(self, tokens_total: int, tokens_exact: int, units_retrieved: int,
                 units_estimated: int, estimated_mass: float) -> None:
        self._values: tuple[int, int, int, int, float] | None = (
            tokens_total, tokens_exact, units_retrieved, units_estimated, estimated_mass)
        self._pending: torch.Tensor | None = None

    @classmethod
    def deferred(cls, values: torch.Tensor) -> QueryStats:
        """Stats whose five fields are ``values`` (``[5]``, float64, any device, in field
        order), read back only when first needed. Integer fields must hold integers."""
        if values.shape != (5,):
            raise ValueError(f"values: expected shape (5,), got {tuple(values.shape)}")
        stats = cls.__new__(cls)
        stats._values, stats._pending = None, values
        return stats

    @property
    def is_materialized(self) -> bool:
        """Whether the values are on the host (always, unless built by :meth:`deferred`
        and not read yet)."""
        return self._values is not None

    @staticmethod
    def materialize(stats: list[QueryStats]) -> None:
        """Read back every deferred stats of ``stats`` with one transfer per device."""
        by_device: dict[torch.device, list[QueryStats]] = {}
        for s in stats:
            if s._pending is not None:
                by_device.setdefault(s._pending.device, []).append(s)
        for group in by_device.values():
            rows = torch.stack([s._pending for s in group]).tolist()  # type: ignore[misc]
            for s, row in zip(group, rows, strict=True):
                s._set(row)

    def _set(self, row: list[float]) -> None:
        self._values = (int(row[0]), int(row[1]), int(row[2]), int(row[3]), float(row[4]))
        self._pending = None

    def _get(self) -> tuple[int, int, int, int, float]:
        if self._values is None:
            assert self._pending is not None
            self._set(self._pending.tolist())
        assert self._values is not None
        return self._values

    @property
    def tokens_total(self) -> int:
        return self._get()[0]

    @property
    def tokens_exact(self) -> int:
        return self._get()[1]

    @property
    def units_retrieved(self) -> int:
        return self._get()[2]

    @property
    def units_estimated(self) -> int:
        return self._get()[3]

    @property
    def estimated_mass(self) -> float:
        return self._get()[4]

    @property
    def exact_fraction(self) -> float:
        """Share of stored tokens read exactly."""
        return self.tokens_exact / self.tokens_total if self.tokens_total else 1.0

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        assert isinstance(other, QueryStats)
        return self._get() == other._get()

    def __hash__(self) -> int:
        return hash(self._get())

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in zip(_STAT_FIELDS, self._get(), strict=True))
        return f"QueryStats({fields})"

    def __reduce__(self) -> tuple[type, tuple[int, int, int, int, float]]:
        return (QueryStats, self._get())


@dataclass(frozen=True, slots=True)
class QueryResult:
    """Attention over a stored sequence.

    Attributes
    ----------
    out : torch.Tensor
        ``[Hq, L, D]`` (or ``[B, Hq, L, D]`` for batched queries), the query's dtype.
    lse : torch.Tensor
        ``[Hq, L]`` (or ``[B, Hq, L]``) float32 log-sum-exp of the scaled scores, so
        results over disjoint token sets merge exactly.
    stats : QueryStats
        Counts of what the query read and estimated.
    """

    out: torch.Tensor
    lse: torch.Tensor
    stats: QueryStats


@dataclass(frozen=True, slots=True)
class SearchResult:
    """The raw index probe: the best-ranked units of each KV head.

    Attributes
    ----------
    ids : torch.Tensor
        ``[Hkv, k]`` int64 unit ids, best first; -1 where a head has fewer than k units.
    scores : torch.Tensor
        ``[Hkv, k]`` float32 ranking scores (``-inf`` for missing units).
    """

    ids: torch.Tensor
    scores: torch.Tensor
