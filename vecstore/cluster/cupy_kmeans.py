"""Batched spherical k-means in CuPy (CUDA only), sharing memory with torch via DLPack."""

from __future__ import annotations

import torch

from vecstore.cluster.base import CLUSTERERS
from vecstore.errors import BackendUnavailableError

__all__ = ["CupyClusterer"]


@CLUSTERERS.register("cupy")
class CupyClusterer:
    """The torch clusterer's algorithm in CuPy: batched ``matmul`` + ``argmax`` + scatter."""

    def __init__(self, seed: int = 0) -> None:
        try:
            import cupy
        except ImportError:
            raise BackendUnavailableError(
                "clusterer 'cupy' needs cupy: pip install 'vecstore[gpu]' "
                "(available without it: 'torch')"
            ) from None
        self._cp = cupy
        self.seed = seed

    def assign(
        self, x: torch.Tensor, counts: torch.Tensor, init: torch.Tensor, iters: int
    ) -> torch.Tensor:
        if not x.is_cuda:
            raise BackendUnavailableError("clusterer 'cupy' needs CUDA tensors; use 'torch' on CPU")
        cp = self._cp
        xs = cp.from_dlpack(x.contiguous())  # [P, n, D]
        c = cp.from_dlpack(init.contiguous()).copy()  # [P, k, D]
        P, n, D = xs.shape
        k = c.shape[1]
        valid = cp.arange(n)[None, :] < cp.from_dlpack(counts.contiguous())[:, None]
        xv = xs * valid[..., None]
        rows = cp.repeat(cp.arange(P), n)
        for _ in range(iters):
            assign = cp.matmul(xs, c.transpose(0, 2, 1)).argmax(-1)  # [P, n]
            sums = cp.zeros((P, k, D), dtype=xs.dtype)
            cp.add.at(sums, (rows, assign.ravel()), xv.reshape(P * n, D))
            norm = cp.linalg.norm(sums, axis=-1, keepdims=True)
            c = cp.where(norm > 0, sums / cp.maximum(norm, 1e-30), c)
        assign = cp.matmul(xs, c.transpose(0, 2, 1)).argmax(-1)
        return torch.from_dlpack(assign.astype(cp.int64))
