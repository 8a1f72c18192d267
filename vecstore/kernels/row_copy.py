"""Rows copied by the GPU, to or from host memory mapped into its address space.

A pinned tier registers a layer's rows with CUDA range by range as they grow
(:class:`vecstore.kvstore.host_pages.HostPages`), so one head's rows may span several
registrations. A DMA copy (``cudaMemcpyAsync``) must lie within one registration;
:func:`copy_rows` has the GPU load and store the rows itself instead, which any mapped
range serves (:func:`vecstore.kvstore.row_transfer.copy_across` picks it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecstore.kernels.backend import LazyKernel, row_stride

__all__ = ["copy_rows"]

_BLOCK_N = 32  # rows per program


def _copy_rows_kernel(src_ptr, dst_ptr, n, src_stride, dst_stride,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    head = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_n < n)[:, None] & (offs_d < D)[None, :]
    rows = offs_n.to(tl.int64)[:, None] * D + offs_d[None, :]
    x = tl.load(src_ptr + head * src_stride * D + rows, mask=mask)
    tl.store(dst_ptr + head * dst_stride * D + rows, x, mask=mask)


_COPY = LazyKernel(_copy_rows_kernel)


def copy_rows(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy ``src [H, n, D]`` into ``dst`` (same shape and dtype) on the current stream;
    each head's ``[n, D]`` rows contiguous in both (heads may sit further apart,
    :func:`~vecstore.kernels.backend.row_stride`). Either may be host memory registered
    with CUDA, in one range or several, the other on the GPU."""
    heads, n, dim = src.shape
    if n == 0:
        return
    _COPY[(heads, triton.cdiv(n, _BLOCK_N))](
        src, dst, n, row_stride(src), row_stride(dst), D=dim,
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_N=_BLOCK_N)
