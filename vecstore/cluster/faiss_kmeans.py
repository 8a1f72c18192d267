"""Spherical k-means through FAISS (faiss-cpu; faiss-gpu where installed).

FAISS has no batched k-means, so problems run one after another. It is the reference
and CPU fallback; the torch clusterer is faster for many small problems.
"""

from __future__ import annotations

import numpy as np
import torch

from vecstore.cluster.base import CLUSTERERS
from vecstore.errors import BackendUnavailableError

__all__ = ["FaissClusterer"]


@CLUSTERERS.register("faiss")
class FaissClusterer:
    """One ``faiss.Kmeans(spherical=True)`` per problem, started from the given init."""

    def __init__(self, seed: int = 0) -> None:
        try:
            import faiss
        except ImportError:
            raise BackendUnavailableError(
                "clusterer 'faiss' needs faiss: pip install 'vecstore[faiss]' "
                "(available without it: 'torch')"
            ) from None
        self._faiss = faiss
        self.seed = seed

    def assign(
        self, x: torch.Tensor, counts: torch.Tensor, init: torch.Tensor, iters: int
    ) -> torch.Tensor:
        faiss = self._faiss
        P, n, D = x.shape
        k = init.shape[1]
        out = torch.zeros(P, n, dtype=torch.long)
        for p in range(P):
            m = int(counts[p])
            pts = np.ascontiguousarray(x[p, :m].detach().cpu().numpy(), dtype=np.float32)
            cent = np.ascontiguousarray(init[p].detach().cpu().numpy(), dtype=np.float32)
            if iters > 0:
                km = faiss.Kmeans(D, k, niter=iters, spherical=True, seed=self.seed,
                                  min_points_per_centroid=1, max_points_per_centroid=1 << 30)
                km.train(pts, init_centroids=cent)
                cent = km.centroids
            index = faiss.IndexFlatIP(D)
            index.add(cent)
            _, ids = index.search(np.ascontiguousarray(x[p].detach().cpu().numpy(),
                                                       dtype=np.float32), 1)
            out[p] = torch.from_numpy(ids[:, 0].astype(np.int64))
        return out.to(x.device)
