"""The assignment step of spherical k-means: every point's centroid of largest inner product.

As a matrix product and an ``argmax`` (:func:`vecstore.cluster.torch_kmeans`'s CPU form) an
iteration writes and reads a ``[P, n, k]`` float32 score tensor and multiplies on the CUDA
cores. :func:`nearest_centroid` is one kernel: a program scores a block of a problem's points
against all of the problem's centroids with TF32 tensor-core dots, a tile of centroids at a
time, and keeps each point's best score and centroid in registers. Ties go to the lower
centroid id, as ``argmax`` breaks them.

TF32 rounds the operands to 10 significant bits (float32 accumulation), so where two
centroids score within about ``1e-3`` of each other the point may take either; the index
builds over keys stored in bfloat16, which carry 8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecstore.kernels.backend import LazyKernel

__all__ = ["nearest_centroid"]

_BLOCK_N = 64  # points per program
_BLOCK_K = 64  # centroids per tile


def _nearest_kernel(x_ptr, c_ptr, out_ptr, n, k, x_stride, c_stride,
                    D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    x = tl.load(x_ptr + p * x_stride + offs_n.to(tl.int64)[:, None] * D + offs_d[None, :],
                mask=(offs_n < n)[:, None], other=0.0)
    best = tl.full([BLOCK_N], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK_N], tl.int32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        c = tl.load(c_ptr + p * c_stride + offs_k.to(tl.int64)[:, None] * D + offs_d[None, :],
                    mask=(offs_k < k)[:, None], other=0.0)
        s = tl.dot(x, tl.trans(c), input_precision="tf32")  # [BLOCK_N, BLOCK_K]
        s = tl.where((offs_k < k)[None, :], s, float("-inf"))
        top = tl.max(s, axis=1)
        at = tl.argmax(s, axis=1).to(tl.int32) + k0
        better = top > best  # an earlier tile keeps a tie: the lower id
        arg = tl.where(better, at, arg)
        best = tl.where(better, top, best)
    tl.store(out_ptr + p * n + offs_n, arg.to(tl.int64), mask=offs_n < n)


_NEAREST = LazyKernel(_nearest_kernel)


def nearest_centroid(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Index of the centroid of largest inner product with each point, on ``x``'s device.

    Parameters
    ----------
    x : torch.Tensor
        ``[P, n, D]`` float32 points of ``P`` problems, contiguous; ``D`` a power of two
        of at least 16 (a ``tl.dot`` operand).
    centroids : torch.Tensor
        ``[P, k, D]`` float32 centroids, contiguous, ``k >= 1``.

    Returns
    -------
    torch.Tensor
        ``[P, n]`` int64 ids in ``[0, k)``.
    """
    P, n, D = x.shape
    k = centroids.shape[1]
    x, centroids = x.contiguous(), centroids.contiguous()
    out = torch.empty(P, n, dtype=torch.int64, device=x.device)
    if P and n:
        _NEAREST[(P, triton.cdiv(n, _BLOCK_N))](
            x, centroids, out, n, k, n * D, k * D, D=D, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K)
    return out
