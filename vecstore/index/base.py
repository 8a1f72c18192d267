"""The Index interface and the data it builds: segments and batched views of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from vecstore.registry import Registry

__all__ = ["Segment", "IndexView", "UnitSummary", "Index", "EstimatingIndex", "INDEXES"]


@dataclass(frozen=True, slots=True)
class Segment:
    """One indexed token range of one layer, stored unit-contiguous per KV head.

    Attributes
    ----------
    start, end : int
        Token positions ``[start, end)`` covered.
    keys, values : torch.Tensor
        ``[Hkv, N, D]`` rows ordered unit by unit (``N = end - start``).
    offsets : torch.Tensor
        ``[Hkv, U + 1]`` int64: unit ``u`` of head ``h`` is rows ``offsets[h, u]:offsets[h, u+1]``.
    meta : dict[str, torch.Tensor]
        Per-unit tensors ``[Hkv, U, ...]`` the index ranks or estimates with (e.g.
        ``centroids`` and ``value_sums`` for ``wave``, ``kmin``/``kmax`` for ``quest``).
    """

    start: int
    end: int
    keys: torch.Tensor
    values: torch.Tensor
    offsets: torch.Tensor
    meta: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_units(self) -> int:
        return self.offsets.shape[1] - 1


@dataclass(frozen=True, slots=True)
class IndexView:
    """The indexed part of one layer for ``B`` sequences, padded to common sizes.

    Attributes
    ----------
    keys, values : torch.Tensor
        ``[B, Hkv, N, D]`` unit-contiguous rows (padding rows are zeros).
    offsets : torch.Tensor
        ``[B, Hkv, C + 1]`` int64 row offsets; padding units have size 0.
    sizes : torch.Tensor
        ``[B, Hkv, C]`` int64 rows per unit (0 = no such unit).
    meta : dict[str, torch.Tensor]
        ``[B, Hkv, C, ...]`` per-unit tensors.
    num_units : torch.Tensor
        ``[B]`` int64 units of each sequence (before padding).
    """

    keys: torch.Tensor
    values: torch.Tensor
    offsets: torch.Tensor
    sizes: torch.Tensor
    meta: dict[str, torch.Tensor]
    num_units: torch.Tensor

    @staticmethod
    def from_segments(segments: list[Segment]) -> IndexView:
        """Concatenate one sequence's segments into a ``B = 1`` view."""
        keys = torch.cat([s.keys for s in segments], dim=1)
        values = torch.cat([s.values for s in segments], dim=1)
        parts, base = [segments[0].offsets[:, :1]], 0
        for s in segments:
            parts.append(s.offsets[:, 1:] + base)
            base += s.num_tokens
        offsets = torch.cat(parts, dim=1)
        meta = {k: torch.cat([s.meta[k] for s in segments], dim=1) for k in segments[0].meta}
        return IndexView(
            keys=keys[None], values=values[None], offsets=offsets[None],
            sizes=offsets.diff(dim=-1)[None], meta={k: v[None] for k, v in meta.items()},
            num_units=torch.tensor([offsets.shape[1] - 1]),
        )

    @staticmethod
    def stack(views: list[IndexView],
              rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> IndexView:
        """Stack ``B = 1`` views into one batch, padding tokens and units.

        ``rows``: the batch's ``[B, Hkv, N, D]`` keys and values, already holding the views'
        rows, zero-padded (the caller placed them, e.g. in a KV tier); only the metadata is
        stacked then. By default the views' rows are concatenated.
        """
        if len(views) == 1 and rows is None:
            return views[0]
        n = max(v.keys.shape[2] for v in views)
        c = max(v.sizes.shape[2] for v in views)

        def pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
            extra = size - x.shape[dim]
            if extra == 0:
                return x
            shape = list(x.shape)
            shape[dim] = extra
            return torch.cat([x, x.new_zeros(shape)], dim=dim)

        if rows is None:
            rows = (torch.cat([pad(v.keys, 2, n) for v in views]),
                    torch.cat([pad(v.values, 2, n) for v in views]))
        # padding units repeat the last offset, so they have size 0
        offsets = [torch.cat([v.offsets, v.offsets[..., -1:].expand(
            -1, -1, c + 1 - v.offsets.shape[2])], dim=2) for v in views]
        return IndexView(
            keys=rows[0], values=rows[1],
            offsets=torch.cat(offsets),
            sizes=torch.cat([pad(v.sizes, 2, c) for v in views]),
            meta={k: torch.cat([pad(v.meta[k], 2, c) for v in views]) for k in views[0].meta},
            num_units=torch.cat([v.num_units for v in views]),
        )


@dataclass(frozen=True, slots=True)
class UnitSummary:
    """What an estimating index knows of each unit of a view: the decode step's inputs for
    ranking units by centroid and approximating the unretrieved ones.

    Attributes
    ----------
    centroids : torch.Tensor
        ``[B, Hkv, C, D]`` float32 mean key of each unit.
    value_sums : torch.Tensor
        ``[B, Hkv, C, D]`` float32 sum of each unit's values.
    radii : torch.Tensor
        ``[B, Hkv, C]`` float32 largest distance from a unit's centroid to its keys.
    radius_weight : float
        ``w`` of the ranking logit ``q·c + w·|q|·r``; 0 ranks by the centroids alone.
    """

    centroids: torch.Tensor
    value_sums: torch.Tensor
    radii: torch.Tensor
    radius_weight: float


@runtime_checkable
class Index(Protocol):
    """Organises a layer's indexed tokens into units and ranks units for a query.

    ``can_estimate`` says whether the index is an :class:`EstimatingIndex`, whose
    :meth:`~EstimatingIndex.summarize` lets the estimation zone approximate unretrieved
    units; ``is_exact`` says every unit must always be retrieved.
    """

    can_estimate: bool
    is_exact: bool

    def build(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> list[Segment]:
        """Index tokens ``[start, start + N)``.

        Every head is indexed on its own: the rows of several sequences stacked along the
        head axis (``[B * Hkv, N, D]``) build each sequence's segments stacked the same way
        (a batch's segments are built in one call, :mod:`vecstore.engine.batch_build`).

        Parameters
        ----------
        keys, values : torch.Tensor
            ``[Hkv, N, D]`` in token order.
        start : int
            Position of the first token.
        """
        ...

    def rank(self, view: IndexView, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Score every unit for query ``q`` (higher = fetch first).

        Parameters
        ----------
        view : IndexView
            The indexed units of ``B`` sequences.
        q : torch.Tensor
            ``[B, Hkv, G, L, D]`` float32 queries grouped by KV head.
        scale : float
            Softmax scale.

        Returns
        -------
        torch.Tensor
            ``[B, Hkv, C]`` float32; ``-inf`` for units of size 0.
        """
        ...


@runtime_checkable
class EstimatingIndex(Index, Protocol):
    """An index whose units carry centroids and value sums (``can_estimate`` is true)."""

    def summarize(self, view: IndexView) -> UnitSummary:
        """The centroids, value sums and radii of ``view``'s units (views, not copies)."""
        ...


INDEXES: Registry[type] = Registry("index")
