"""The Clusterer interface: batched spherical k-means over many small problems."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from vecstore.registry import Registry

__all__ = ["Clusterer", "CLUSTERERS", "strided_init"]


@runtime_checkable
class Clusterer(Protocol):
    """Spherical k-means over a batch of independent problems.

    Implementations receive unit-norm points and initial centroids and return the
    final assignment of every point. Problems are ``P`` (KV heads x segments) sets of
    ``n`` points each; ``counts[p]`` of them are valid (the rest are padding).
    """

    def assign(
        self, x: torch.Tensor, counts: torch.Tensor, init: torch.Tensor, iters: int
    ) -> torch.Tensor:
        """Run ``iters`` spherical iterations from ``init`` and assign every point.

        Parameters
        ----------
        x : torch.Tensor
            ``[P, n, D]`` float32 unit-norm points (padding rows arbitrary).
        counts : torch.Tensor
            ``[P]`` int64 number of valid points per problem.
        init : torch.Tensor
            ``[P, k, D]`` float32 unit-norm initial centroids.
        iters : int
            Spherical iterations (assign by inner product, re-normalised mean update).

        Returns
        -------
        torch.Tensor
            ``[P, n]`` int64 cluster of each point (padding rows: any value).
        """
        ...


CLUSTERERS: Registry[type] = Registry("clusterer")


def strided_init(x: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """Evenly strided initial centroids: ``k`` points at equal steps through each problem.

    Parameters
    ----------
    x : torch.Tensor
        ``[P, n, D]`` points.
    counts : torch.Tensor
        ``[P]`` valid points per problem.
    k : int
        Clusters per problem.

    Returns
    -------
    torch.Tensor
        ``[P, k, D]`` copies of the chosen points.
    """
    steps = torch.arange(k, device=x.device, dtype=torch.float64) / k  # [k]
    idx = (steps[None, :] * counts.to(torch.float64)[:, None]).long()  # [P, k]
    idx = idx.clamp_max((counts - 1).clamp_min(0)[:, None])
    return torch.gather(x, 1, idx[..., None].expand(-1, -1, x.shape[-1]))
