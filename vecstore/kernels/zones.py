"""The retrieval and estimation zones of a decode step, as the kernels write and read them.

The index probe (:mod:`vecstore.kernels.zone_select`) writes them; the three zones' attention
and the wave buffer's slot lookup and copies read them. Rows are ``b * Hkv + h``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Zones"]


@dataclass(frozen=True, slots=True)
class Zones:
    """The zones :func:`~vecstore.kernels.zone_select.select_zones` writes, per row.

    Attributes
    ----------
    zone : torch.Tensor
        ``[rows, C]`` int8: 1 retrieved, 2 estimated, 0 dropped.
    ids : torch.Tensor
        ``[rows, R]`` int32 retrieved cluster ids in cluster order (first ``count`` valid).
    first_row : torch.Tensor
        ``[rows, R]`` int32 first KV row of each retrieved cluster.
    cum : torch.Tensor
        ``[rows, R + 1]`` int32 running sum of retrieved sizes: cluster ``i`` fills
        execution rows ``cum[i]:cum[i + 1]``; ``cum[count]`` is the row total.
    count : torch.Tensor
        ``[rows]`` int32 retrieved clusters.
    est_ids : torch.Tensor
        ``[rows, E]`` int32 estimated cluster ids in cluster order (first ``est_count``
        valid; none kept when ``E`` is 0).
    est_count : torch.Tensor
        ``[rows]`` int32 estimated clusters.
    """

    zone: torch.Tensor
    ids: torch.Tensor
    first_row: torch.Tensor
    cum: torch.Tensor
    count: torch.Tensor
    est_ids: torch.Tensor
    est_count: torch.Tensor

    def rows(self, start: int, stop: int) -> Zones:
        """The zones of rows ``start:stop`` (views: writing them writes these)."""
        return Zones(*(getattr(self, f)[start:stop] for f in Zones.__slots__))

    @staticmethod
    def empty(rows: int, num_clusters: int, r_max: int, device: torch.device,
              e_max: int = 0) -> Zones:
        """Buffers for ``rows`` rows of ``num_clusters`` clusters, at most ``r_max`` retrieved
        and ``e_max`` estimated ids kept."""
        i32 = torch.int32
        return Zones(
            zone=torch.empty(rows, num_clusters, dtype=torch.int8, device=device),
            ids=torch.empty(rows, r_max, dtype=i32, device=device),
            first_row=torch.empty(rows, r_max, dtype=i32, device=device),
            cum=torch.empty(rows, r_max + 1, dtype=i32, device=device),
            count=torch.empty(rows, dtype=i32, device=device),
            est_ids=torch.empty(rows, e_max, dtype=i32, device=device),
            est_count=torch.empty(rows, dtype=i32, device=device),
        )
