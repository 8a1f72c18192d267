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


@dataclass(frozen=True, slots=True)
class QueryStats:
    """What one query did, summed over its KV heads (and batch rows).

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
    """

    tokens_total: int
    tokens_exact: int
    units_retrieved: int
    units_estimated: int
    estimated_mass: float

    @property
    def exact_fraction(self) -> float:
        """Share of stored tokens read exactly."""
        return self.tokens_exact / self.tokens_total if self.tokens_total else 1.0


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
