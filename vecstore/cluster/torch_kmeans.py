"""Batched spherical k-means in torch (CPU and CUDA): the default clusterer."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vecstore.cluster.base import CLUSTERERS

__all__ = ["TorchClusterer"]

# Score tensors [P, n, k] are computed this many problems at a time, bounding memory.
_MAX_SCORE_ELEMENTS = 1 << 26


@CLUSTERERS.register("torch")
class TorchClusterer:
    """Spherical k-means as batched matrix products (``bmm`` + ``argmax`` + ``scatter_add``).

    Empty clusters keep their previous centroid, so an assignment never points at a
    centroid that was not updated from data or initialisation.

    Examples
    --------
    >>> x = F.normalize(torch.randn(2, 40, 8), dim=-1)
    >>> counts = torch.tensor([40, 33])
    >>> assign = TorchClusterer().assign(x, counts, x[:, :4].clone(), iters=3)
    >>> assign.shape, int(assign.max()) < 4
    (torch.Size([2, 40]), True)
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def assign(
        self, x: torch.Tensor, counts: torch.Tensor, init: torch.Tensor, iters: int
    ) -> torch.Tensor:
        P, n, _ = x.shape
        k = init.shape[1]
        step = max(1, _MAX_SCORE_ELEMENTS // max(1, n * k))
        parts = [
            self._assign_chunk(x[i:i + step], counts[i:i + step], init[i:i + step], iters)
            for i in range(0, P, step)
        ]
        return torch.cat(parts) if parts else torch.empty(0, n, dtype=torch.long)

    @staticmethod
    def _assign_chunk(
        x: torch.Tensor, counts: torch.Tensor, c: torch.Tensor, iters: int
    ) -> torch.Tensor:
        P, n, D = x.shape
        k = c.shape[1]
        valid = torch.arange(n, device=x.device)[None, :] < counts[:, None]  # [P, n]
        xv = x * valid[..., None]
        for _ in range(iters):
            assign = torch.bmm(x, c.transpose(1, 2)).argmax(-1)  # [P, n]
            sums = torch.zeros(P, k, D, device=x.device, dtype=x.dtype)
            sums.scatter_add_(1, assign[..., None].expand(-1, -1, D), xv)
            filled = sums.norm(dim=-1, keepdim=True) > 0  # [P, k, 1]
            c = torch.where(filled, F.normalize(sums, dim=-1), c)
        return torch.bmm(x, c.transpose(1, 2)).argmax(-1)
