"""Row access and vector primitives of the CPU decode step (Numba, inlined into it).

KV rows come as ``[rows, D]`` tables. Numba has no half-precision types: bfloat16 rows are
passed as their 16-bit patterns and widened to float32 as they are read (exactly); float32
rows are read in place.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
import numpy.typing as npt
from numba.extending import overload

__all__ = ["FAST", "row", "dot", "axpy", "cap", "score_rows", "weigh_rows"]

_Array = npt.NDArray[Any]
FAST = {"reassoc", "contract", "nsz", "arcp"}
"""Numba ``fastmath`` flags: reassociation lets LLVM vectorise the dot products; no
"nnan"/"ninf", because -inf marks clusters that do not exist and rows with nothing to
attend to."""


# (no annotations on row and its overload: Numba matches their signatures exactly)
def row(table, i, bits, wide):  # type: ignore[no-untyped-def]
    """Row ``i`` of ``table`` as float32: a view of a float32 table, or a uint16 table's
    bfloat16 row widened into ``wide`` (``bits`` is ``wide`` as uint32). Compiled code
    uses the overload below; this is the same in Python (``NUMBA_DISABLE_JIT``).

    Examples
    --------
    >>> import torch
    >>> x = torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16).view(torch.uint16).numpy()
    >>> bits = np.empty(2, np.uint32)
    >>> row(x, 0, bits, bits.view(np.float32)).tolist()
    [1.5, -2.0]
    """
    if table.dtype == np.float32:
        return table[i]
    bits[:] = table[i].astype(np.uint32) << 16
    return wide


@overload(row, inline="always")
def _row_compiled(table, i, bits, wide):  # type: ignore[no-untyped-def]
    if table.dtype == numba.types.float32:
        return lambda table, i, bits, wide: table[i]

    def widen(table, i, bits, wide):  # type: ignore[no-untyped-def]
        src = table[i]
        for d in range(src.shape[0]):  # a bfloat16 is the top half of a float32
            bits[d] = np.uint32(src[d]) << 16
        return wide

    return widen


@numba.njit(inline="always", fastmath=FAST)
def dot(a: _Array, b: _Array) -> float:
    """``a · b`` in float32."""
    acc = np.float32(0.0)
    for d in range(a.shape[0]):
        acc += a[d] * b[d]
    return acc


@numba.njit(inline="always", fastmath=FAST)
def axpy(a: float, x: _Array, y: _Array) -> None:
    """``y += a * x`` in place."""
    for d in range(x.shape[0]):
        y[d] += a * x[d]


@numba.njit(inline="always")
def cap(x: float, softcap: float) -> float:
    """``softcap * tanh(x / softcap)``, or ``x`` when ``softcap`` is 0 (no cap)."""
    return softcap * math.tanh(x / softcap) if softcap > 0 else x


@numba.njit(inline="always", fastmath=FAST)
def score_rows(q: _Array, table: _Array, first: int, count: int, scale: float,
               softcap: float, logits: _Array, pos: int, bits: _Array, wide: _Array) -> int:
    """Scores of rows ``first, ..., first + count - 1`` of ``table`` for every query head,
    into ``logits[:, pos:]``; returns the next free position."""
    for t in range(count):
        k = row(table, first + t, bits, wide)
        for g in range(q.shape[0]):
            logits[g, pos + t] = cap(dot(q[g], k) * scale, softcap)
    return pos + count


@numba.njit(inline="always", fastmath=FAST)
def weigh_rows(probs: _Array, table: _Array, first: int, count: int, acc: _Array, pos: int,
               bits: _Array, wide: _Array) -> int:
    """Add rows ``first, ...`` of ``table`` weighed by ``probs[:, pos:]`` to ``acc``;
    returns the next position."""
    for t in range(count):
        v = row(table, first + t, bits, wide)
        for g in range(acc.shape[0]):
            axpy(probs[g, pos + t], v, acc[g])
    return pos + count
