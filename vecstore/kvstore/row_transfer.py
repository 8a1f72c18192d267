"""Rows copied between a GPU and host memory registered with CUDA (the pinned tier's).

The pinned tier registers a layer's rows range by range as they grow
(:class:`vecstore.kvstore.host_pages.HostPages`), and keeps a layer's heads a reserve
apart, so a head's rows may span several registrations and a layer's rows are not one
contiguous block. A DMA copy must lie within one registration, and torch copies into a
non-contiguous host tensor through a pageable staging buffer and a copy on the CPU. Between
a GPU and registered host memory :func:`copy_across` has the GPU load and store the rows
itself (:func:`vecstore.kernels.row_copy.copy_rows`), which any mapped range serves.
Copies into host memory made within :func:`host_writes_together` are waited for once, when
the outermost one ends, so the host's work between them overlaps the GPU's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from vecstore.kernels.backend import has_triton

__all__ = ["copy_across", "host_writes_together"]

# the streams whose copies into host memory are waited for when host_writes_together ends
_pending: ContextVar[dict[int, torch.cuda.Stream] | None] = ContextVar(
    "vecstore_pending_host_writes", default=None)


@contextlib.contextmanager
def host_writes_together() -> Iterator[None]:
    """Within it, :func:`copy_across` into host memory returns without waiting; on leaving,
    the host waits for every such copy (once per stream), the rows then in host memory.
    Entered within another, it joins that one: its copies are waited for when the
    outermost ends.

    Examples
    --------
    >>> dst = torch.zeros(2, 3)
    >>> with host_writes_together():
    ...     copy_across(torch.ones(2, 3), dst)
    >>> float(dst.sum())
    6.0
    """
    if _pending.get() is not None:
        yield
        return
    streams: dict[int, torch.cuda.Stream] = {}
    token = _pending.set(streams)
    try:
        yield
    finally:
        _pending.reset(token)
        for stream in streams.values():
            stream.synchronize()


def copy_across(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy ``src`` into ``dst``: ``[..., n, D]`` rows of the same shape, each ``[n, D]``
    block contiguous and the blocks evenly spaced (the leading dims view as one).

    Between a CUDA device and host memory registered with CUDA the rows go through a copy
    kernel on the current stream: asynchronously into the GPU (stream-ordered readers see
    them), and into host memory before returning (the host may read them next), or, within
    :func:`host_writes_together`, before it ends. Anything else is ``dst.copy_(src)``.

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
        stream, pending = torch.cuda.current_stream(gpu.device), _pending.get()
        if pending is None:
            stream.synchronize()
        else:
            pending[stream.cuda_stream] = stream


def _heads(rows: torch.Tensor) -> torch.Tensor:
    """``rows [..., n, D]`` viewed as ``[heads, n, D]`` (no copy)."""
    return rows.view(-1, *rows.shape[-2:]) if rows.dim() != 3 else rows
