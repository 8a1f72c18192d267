"""Rows copied between a GPU and host memory registered with CUDA (the pinned tier's).

The pinned tier registers a layer's rows range by range as they grow
(:class:`vecstore.kvstore.host_pages.HostPages`), and keeps a layer's heads a reserve
apart, so a head's rows may span several registrations and a layer's rows are not one
contiguous block. A DMA copy must lie within one registration, and torch copies into a
non-contiguous host tensor through a pageable staging buffer and a copy on the CPU. Between
a GPU and registered host memory :func:`copy_across` has the GPU load and store the rows
itself (:func:`vecstore.kernels.row_copy.copy_rows`), which any mapped range serves.
"""

from __future__ import annotations

import torch

from vecstore.kernels.backend import has_triton

__all__ = ["copy_across"]


def copy_across(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy ``src`` into ``dst``: ``[..., n, D]`` rows of the same shape, each ``[n, D]``
    block contiguous and the blocks evenly spaced (the leading dims view as one).

    Between a CUDA device and host memory registered with CUDA the rows go through a copy
    kernel on the current stream: asynchronously into the GPU (stream-ordered readers see
    them), and into host memory before returning (the host may read them next). Anything
    else is ``dst.copy_(src)``.

    Examples
    --------
    >>> dst = torch.zeros(2, 3, 4)
    >>> copy_across(torch.ones(2, 3, 4), dst); float(dst.sum())
    24.0
    """
    gpu, host = (src, dst) if src.is_cuda else (dst, src)
    if not (gpu.is_cuda and host.device.type == "cpu" and has_triton() and host.is_pinned()):
        dst.copy_(src)
        return
    from vecstore.kernels.row_copy import copy_rows

    copy_rows(_heads(src), _heads(dst))
    if dst is host:
        torch.cuda.current_stream(gpu.device).synchronize()


def _heads(rows: torch.Tensor) -> torch.Tensor:
    """``rows [..., n, D]`` viewed as ``[heads, n, D]`` (no copy)."""
    return rows.view(-1, *rows.shape[-2:]) if rows.dim() != 3 else rows
