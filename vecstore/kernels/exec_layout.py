"""Where a step's retrieved clusters sit in the wave buffer's execution buffer.

The slot lookup (:mod:`vecstore.kernels.slot_table`) writes it; the cluster copies
(:mod:`vecstore.kernels.cluster_copy`) read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ExecLayout"]


@dataclass(frozen=True, slots=True)
class ExecLayout:
    """Where a step's retrieved clusters sit in the execution buffer: a row's hits first,
    then its misses, each in retrieved order (written by
    :func:`~vecstore.kernels.slot_table.lookup_slots`, read by the copies between the
    tiers).

    Attributes
    ----------
    count : torch.Tensor
        ``[rows]`` int32 retrieved clusters.
    size : torch.Tensor
        ``[rows, R]`` int32 rows of each retrieved cluster.
    pos : torch.Tensor
        ``[rows, R]`` int32 place of a cluster's first row among the row's hit rows (a hit;
        execution row ``pos``) or among its miss rows (a miss; execution row
        ``split + pos``).
    split : torch.Tensor
        ``[rows]`` int32 hit rows: where the misses start.
    """

    count: torch.Tensor
    size: torch.Tensor
    pos: torch.Tensor
    split: torch.Tensor

    @staticmethod
    def empty(rows: int, r_max: int, device: torch.device) -> ExecLayout:
        """Zeroed buffers for ``rows`` rows of at most ``r_max`` retrieved clusters."""
        i32 = torch.int32
        return ExecLayout(torch.zeros(rows, dtype=i32, device=device),
                          torch.zeros(rows, r_max, dtype=i32, device=device),
                          torch.zeros(rows, r_max, dtype=i32, device=device),
                          torch.zeros(rows, dtype=i32, device=device))
