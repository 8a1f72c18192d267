"""Gather selected cluster blocks from a CPU store into one contiguous buffer, with Numba.

The store keeps each KV head's rows cluster-contiguous, so a cluster is a row range
``[start, start + length)``. A step's misses are gathered head by head, back to back,
into a staging buffer that is then copied to the GPU in one transfer. Numba has no
half-precision types, so 16- and 32-bit floats are moved as integers of the same
width: the copy is bit-exact.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numba
import numpy as np
import numpy.typing as npt
import torch

from vecstore.checks import SUPPORTED_DTYPES, check_tensor
from vecstore.errors import InvalidValueError, ShapeError
from vecstore.kernels.backend import row_stride

__all__ = ["Gathered", "gather_clusters"]

_Array = npt.NDArray[Any]
# same-width integer views: numpy has no bfloat16
# below this many bytes a gather runs on one thread
_PARALLEL_BYTES = 4 << 20
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


class Gathered(NamedTuple):
    """Result of :func:`gather_clusters`.

    Attributes
    ----------
    out : torch.Tensor
        ``[Hkv, M, D]`` buffer; head ``h``'s clusters fill rows ``[0, lengths[h])``,
        the rest is untouched.
    lengths : torch.Tensor
        ``[Hkv]`` int64 rows filled per head.
    """

    out: torch.Tensor
    lengths: torch.Tensor


@numba.njit(parallel=True, nogil=True, cache=True)
def _gather(store: _Array, starts: _Array, lengths: _Array, out: _Array, filled: _Array) -> None:
    """Fill ``out`` with each head's ranges back to back; ``filled`` gets each head's total."""
    num_heads, num_ranges = starts.shape
    offsets = np.empty((num_heads, num_ranges), np.int64)
    for h in range(num_heads):
        pos = 0
        for r in range(num_ranges):
            offsets[h, r] = pos
            pos += lengths[h, r]
        filled[h] = pos
    # one parallel task per (head, cluster): clusters are small, heads are few
    for i in numba.prange(num_heads * num_ranges):
        h = i // num_ranges
        r = i % num_ranges
        src, dst, n = starts[h, r], offsets[h, r], lengths[h, r]
        out[h, dst : dst + n] = store[h, src : src + n]


def gather_clusters(
    store: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor | None = None,
) -> Gathered:
    """Copy each head's selected row ranges of ``store`` back to back into ``out``.

    Parameters
    ----------
    store : torch.Tensor
        ``[Hkv, N, D]`` float32, float16 or bfloat16 on the CPU (pinned or not), each
        head's ``[N, D]`` rows contiguous: keys or values of one layer, cluster-contiguous
        per head.
    starts : torch.Tensor
        ``[Hkv, R]`` int64 first row of each selected cluster.
    lengths : torch.Tensor
        ``[Hkv, R]`` int64 rows of each selected cluster (0 skips the entry).
    out : torch.Tensor, optional
        ``[Hkv, M, D]`` contiguous CPU buffer of ``store``'s dtype with ``M`` at least
        every head's total length; allocated with the largest total if omitted.

    Returns
    -------
    Gathered
        ``(out, lengths)``: the buffer and the ``[Hkv]`` int64 rows filled per head.

    Raises
    ------
    ShapeError
        A tensor has the wrong shape, dtype or device, or is not contiguous.
    InvalidValueError
        A range is negative or runs past the store's ``N`` rows, or ``out`` is too short.

    Examples
    --------
    >>> store = torch.arange(12.0).reshape(1, 6, 2)
    >>> g = gather_clusters(store, torch.tensor([[4, 0]]), torch.tensor([[2, 1]]))
    >>> g.out[0].tolist(), g.lengths.tolist()
    ([[8.0, 9.0], [10.0, 11.0], [0.0, 1.0]], [3])
    """
    check_tensor(store, "store", shape=(None, None, None))
    if store.dtype not in _BITS:
        raise ShapeError(f"store: expected dtype one of {sorted(SUPPORTED_DTYPES)}, "
                         f"got {str(store.dtype).removeprefix('torch.')}")
    _check_layout(store, "store", contiguous=False)
    row_stride(store)  # each head's rows contiguous (heads may sit further apart)
    num_heads, num_rows, dim = store.shape
    check_tensor(starts, "starts", shape=(num_heads, None), dtype=torch.int64)
    _check_layout(starts, "starts", contiguous=False)
    check_tensor(lengths, "lengths", shape=tuple(starts.shape), dtype=torch.int64)
    _check_layout(lengths, "lengths", contiguous=False)
    _check_ranges(starts, lengths, num_rows)
    totals = lengths.sum(dim=1)
    need = int(totals.max()) if totals.numel() else 0
    if out is None:
        out = torch.empty((num_heads, need, dim), dtype=store.dtype)
    else:
        check_tensor(out, "out", shape=(num_heads, None, dim), dtype=store.dtype)
        _check_layout(out, "out", contiguous=True)
        if out.shape[1] < need:
            head = int(totals.argmax())
            raise InvalidValueError(
                f"out: holds {out.shape[1]} rows per head, but head {head} gathers {need}; "
                f"pass out with shape ({num_heads}, >= {need}, {dim})"
            )
    filled = np.empty(num_heads, dtype=np.int64)
    bits = _BITS[store.dtype]
    # waking worker threads costs milliseconds on a busy machine: small gathers run on one
    threads = numba.get_num_threads()
    if need * num_heads * dim * store.element_size() < _PARALLEL_BYTES:
        numba.set_num_threads(1)
    try:
        _gather(store.view(bits).numpy(), starts.contiguous().numpy(),
                lengths.contiguous().numpy(), out.view(bits).numpy(), filled)
    finally:
        numba.set_num_threads(threads)
    return Gathered(out, torch.from_numpy(filled))


def _check_layout(x: torch.Tensor, name: str, *, contiguous: bool) -> None:
    """``x`` must be on the CPU and, where asked, contiguous."""
    if x.device.type != "cpu":
        raise ShapeError(f"{name}: expected a CPU tensor, got one on {x.device}")
    if contiguous and not x.is_contiguous():
        raise ShapeError(f"{name}: expected a contiguous tensor; call .contiguous() first")


def _check_ranges(starts: torch.Tensor, lengths: torch.Tensor, num_rows: int) -> None:
    """Every ``[start, start + length)`` must lie within ``[0, num_rows)``."""
    for name, values in (("starts", starts), ("lengths", lengths)):
        bad = (values < 0).nonzero()
        if len(bad):
            h, r = bad[0].tolist()
            raise InvalidValueError(f"{name}[{h}, {r}]: expected >= 0, got {int(values[h, r])}")
    bad = (starts > num_rows - lengths).nonzero()  # no overflow: lengths >= 0
    if len(bad):
        h, r = bad[0].tolist()
        s, n = int(starts[h, r]), int(lengths[h, r])
        raise InvalidValueError(
            f"starts[{h}, {r}] + lengths[{h}, {r}]: rows [{s}, {s + n}) run past the "
            f"store's {num_rows} rows"
        )
