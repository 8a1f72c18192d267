"""The wave decode step on the CPU in one Numba pass: ranking, zones and attention fused.

One call serves every (sequence, KV head) row of a batch, a row per parallel task: it
scores the row's clusters (the wave index's ranking, :meth:`vecstore.index.wave.WaveIndex.rank`:
``scale * (q·c + w·|q|·r)``, a softmax over clusters per query head, summed over the GQA
group), orders them best first (ties to the lower cluster id), and attends exactly to the
steady zone and the retrieved clusters' rows, read in place, and approximately to the
estimated clusters (:func:`vecstore.kernels.reference.estimate`), all merged in one softmax.
It computes what :class:`~vecstore.executor.torch_ref.TorchExecutor` computes from the
same plan, in float32, without the reference's ~40 small torch operations per layer.

KV rows come as ``[rows, D]`` tables with each (sequence, head)'s first row given, so
rows a tier keeps a reserve apart are read where they are. Numba has no half-precision
types: bfloat16 rows are passed as their 16-bit patterns and widened to float32 as read
(exact); float32 rows are read directly.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
import numpy.typing as npt
from numba.extending import overload

__all__ = ["decode_rows"]

_Array = npt.NDArray[Any]
# reassociation lets LLVM vectorise the dot products; no "nnan"/"ninf": -inf marks
# clusters that do not exist and rows with nothing to attend to
_FAST = {"reassoc", "contract", "nsz", "arcp"}


# (no annotations on _row and its overloads: Numba matches their signatures exactly)
def _row(table, i, bits, wide):  # type: ignore[no-untyped-def]
    """Row ``i`` of ``table`` as float32 (a view, or widened into ``wide``)."""
    raise NotImplementedError  # replaced by the overload below inside compiled code


@overload(_row, inline="always")
def _row_impl(table, i, bits, wide):  # type: ignore[no-untyped-def]
    if table.dtype == numba.types.float32:
        return lambda table, i, bits, wide: table[i]

    def widen(table, i, bits, wide):  # type: ignore[no-untyped-def]
        src = table[i]
        for d in range(src.shape[0]):  # a bfloat16 is the top half of a float32
            bits[d] = np.uint32(src[d]) << 16
        return wide

    return widen


@numba.njit(inline="always", fastmath=_FAST)
def _dot(a: _Array, b: _Array) -> float:
    acc = np.float32(0.0)
    for d in range(a.shape[0]):
        acc += a[d] * b[d]
    return acc


@numba.njit(inline="always", fastmath=_FAST)
def _axpy(a: float, x: _Array, y: _Array) -> None:
    for d in range(x.shape[0]):
        y[d] += a * x[d]


@numba.njit(inline="always")
def _cap(x: float, softcap: float) -> float:
    return softcap * math.tanh(x / softcap) if softcap > 0 else x


@numba.njit(inline="always", fastmath=_FAST)
def _score_rows(q: _Array, table: _Array, first: int, count: int, scale: float,
                softcap: float, logits: _Array, pos: int, bits: _Array, wide: _Array) -> int:
    """Scores of rows ``first, ..., first + count - 1`` of ``table`` for every query head,
    into ``logits[:, pos:]``; returns the next free position."""
    for t in range(count):
        k = _row(table, first + t, bits, wide)
        for g in range(q.shape[0]):
            logits[g, pos + t] = _cap(_dot(q[g], k) * scale, softcap)
    return pos + count


@numba.njit(inline="always", fastmath=_FAST)
def _weigh_rows(probs: _Array, table: _Array, first: int, count: int, acc: _Array, pos: int,
                bits: _Array, wide: _Array) -> int:
    """Add rows ``first, ...`` of ``table`` weighed by ``probs[:, pos:]`` to ``acc``;
    returns the next position."""
    for t in range(count):
        v = _row(table, first + t, bits, wide)
        for g in range(acc.shape[0]):
            _axpy(probs[g, pos + t], v, acc[g])
    return pos + count


@numba.njit(fastmath=_FAST)
def _rank(q: _Array, sizes: _Array, centroids: _Array, radii: _Array, scale: float,
          weight: float) -> _Array:
    """Each cluster's ranking key for one row: minus the group-summed softmax of its
    ranking logits (lower ranks first); ``inf`` for clusters of size 0."""
    G = q.shape[0]
    C = sizes.shape[0]
    score = np.zeros(C, np.float32)
    logit = np.empty(C, np.float32)
    for g in range(G):
        qn = math.sqrt(_dot(q[g], q[g]))
        top = -np.inf
        for c in range(C):
            x = -np.inf
            if sizes[c] > 0:
                x = (_dot(q[g], centroids[c]) + weight * qn * radii[c]) * scale
            logit[c] = x
            top = max(top, x)
        if top == -np.inf:
            continue
        den = np.float32(0.0)
        for c in range(C):
            logit[c] = math.exp(logit[c] - top)
            den += logit[c]
        for c in range(C):
            score[c] += logit[c] / den
    for c in range(C):
        score[c] = -score[c] if sizes[c] > 0 else np.inf
    return score


@numba.njit
def _zones(key: _Array, r: int, e: int) -> tuple[_Array, _Array]:
    """The clusters ranked ``[0, r)`` and ``[r, r + e)`` by ``key``, ties to the lower id
    (a stable sort's order), each zone in id order: the ``r``-th and ``(r + e)``-th keys
    by selection, then one pass, instead of sorting the row."""
    retrieved = np.empty(r, np.int64)
    estimated = np.empty(e, np.int64)
    if r + e == 0:
        return retrieved, estimated
    kth = np.partition(key, r + e - 1)
    v2 = kth[r + e - 1]
    v1 = np.partition(kth[:r + e], r - 1)[r - 1] if r else -np.inf
    ties1, ties2 = r, r + e  # how many keys equal to v1 (v2) the first r (r + e) take
    for x in key:
        ties1 -= x < v1
        ties2 -= x < v2
    nr = ne = 0
    for c in range(key.shape[0]):
        x = key[c]
        first_r = x < v1 or (x == v1 and ties1 > 0)
        if x == v1 and ties1 > 0:
            ties1 -= 1
        first_re = x < v2 or (x == v2 and ties2 > 0)
        if x == v2 and ties2 > 0:
            ties2 -= 1
        if first_r:
            retrieved[nr] = c
            nr += 1
        elif first_re:
            estimated[ne] = c
            ne += 1
    return retrieved, estimated


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FAST)
def _decode(q: _Array, keys: _Array, values: _Array, kv_base: _Array, offsets: _Array,
            sizes: _Array, centroids: _Array, radii: _Array, value_sums: _Array,
            steady_keys: _Array, steady_values: _Array, steady_base: _Array,
            steady_len: _Array, retrieve: _Array, estimate: _Array, scale: float,
            weight: float, softcap: float, out: _Array, lse: _Array, mass: _Array,
            counts: _Array) -> None:
    rows, G, D = q.shape
    for i in numba.prange(rows):
        key = _rank(q[i], sizes[i], centroids[i], radii[i], scale, weight)
        valid = 0
        for c in range(sizes.shape[1]):
            valid += sizes[i, c] > 0
        r = min(retrieve[i], valid)
        e = min(estimate[i], valid - r)
        ret, est = _zones(key, r, e)
        exact = steady_len[i]
        for j in range(r):
            exact += sizes[i, ret[j]]
        counts[i, 0], counts[i, 1], counts[i, 2] = exact, r, e
        bits = np.empty(D, np.uint32)
        wide = bits.view(np.float32)
        logits = np.empty((G, exact + e), np.float32)
        # scores: steady rows, retrieved rows, estimated clusters (+ log size)
        pos = _score_rows(q[i], steady_keys, steady_base[i], steady_len[i], scale, softcap,
                          logits, 0, bits, wide)
        for j in range(r):
            c = ret[j]
            pos = _score_rows(q[i], keys, kv_base[i] + offsets[i, c], sizes[i, c], scale,
                              softcap, logits, pos, bits, wide)
        for j in range(e):
            c = est[j]
            log_n = math.log(np.float32(sizes[i, c]))
            for g in range(G):
                logits[g, pos + j] = _cap(_dot(q[i, g], centroids[i, c]) * scale,
                                          softcap) + log_n
        # one softmax over all three zones; the estimated zone's share of its mass
        top = np.full(G, -np.inf, np.float32)
        for g in range(G):
            for t in range(exact + e):
                top[g] = max(top[g], logits[g, t])
        total = np.zeros(G, np.float32)
        estimated = np.zeros(G, np.float32)
        for g in range(G):
            if top[g] == -np.inf:
                continue
            for t in range(exact + e):
                p = math.exp(logits[g, t] - top[g])
                logits[g, t] = p
                total[g] += p
                if t >= exact:
                    estimated[g] += p
        acc = np.zeros((G, D), np.float32)
        pos = _weigh_rows(logits, steady_values, steady_base[i], steady_len[i], acc, 0, bits,
                          wide)
        for j in range(r):
            c = ret[j]
            pos = _weigh_rows(logits, values, kv_base[i] + offsets[i, c], sizes[i, c], acc, pos,
                              bits, wide)
        for j in range(e):
            c = est[j]
            inv_n = np.float32(1.0) / np.float32(sizes[i, c])
            for g in range(G):
                _axpy(logits[g, pos + j] * inv_n, value_sums[i, c], acc[g])
        for g in range(G):
            if top[g] == -np.inf:
                out[i, g] = 0.0
                lse[i, g] = -np.inf
                mass[i, g] = 0.0
            else:
                for d in range(D):
                    out[i, g, d] = acc[g, d] / total[g]
                lse[i, g] = top[g] + math.log(total[g])
                mass[i, g] = estimated[g] / total[g]


def decode_rows(q: _Array, keys: _Array, values: _Array, kv_base: _Array, offsets: _Array,
                sizes: _Array, centroids: _Array, radii: _Array, value_sums: _Array,
                steady_keys: _Array, steady_values: _Array, steady_base: _Array,
                steady_len: _Array, retrieve: _Array, estimate: _Array, *, scale: float,
                weight: float, softcap: float | None,
                ) -> tuple[_Array, _Array, _Array, _Array]:
    """One decode step of ``rows`` (sequence, KV head) pairs; numpy arrays in, out.

    Parameters
    ----------
    q : ndarray
        ``[rows, G, D]`` float32 queries, the ``G`` query heads of each row's KV head.
    keys, values : ndarray
        ``[N, D]`` C-contiguous tables of the indexed rows: float32, or uint16 holding
        bfloat16 bit patterns. Row ``t`` of row ``i``'s clusters is ``kv_base[i] + t``.
    kv_base : ndarray
        ``[rows]`` int64.
    offsets, sizes : ndarray
        ``[rows, C + 1]`` and ``[rows, C]`` int64: cluster ``c`` of row ``i`` is its rows
        ``offsets[i, c]:offsets[i, c + 1]`` (size 0: no such cluster).
    centroids, value_sums : ndarray
        ``[rows, C, D]`` float32 mean key and value sum of each cluster.
    radii : ndarray
        ``[rows, C]`` float32 largest distance from a centroid to its keys.
    steady_keys, steady_values : ndarray
        ``[S, D]`` tables of the steady zone, ``keys``' dtype; row ``i``'s are
        ``steady_base[i] + t`` for ``t < steady_len[i]``.
    steady_base, steady_len : ndarray
        ``[rows]`` int64.
    retrieve, estimate : ndarray
        ``[rows]`` int64 clusters retrieved and estimated (fewer where the row has fewer).
    scale, weight : float
        Softmax scale; radius weight ``w`` of the ranking logit.
    softcap : float | None
        Logit soft-cap of every zone's scores; ``None``: none.

    Returns
    -------
    tuple
        ``out [rows, G, D]`` and ``lse [rows, G]`` float32 (``-inf`` and zeros for a row
        with nothing to attend to), the estimated zone's share of each query head's
        softmax mass ``[rows, G]``, and per row the rows read exactly, the clusters
        retrieved and the clusters estimated ``[rows, 3]`` int64.

    Examples
    --------
    >>> z = np.zeros((1, 2), np.float32)
    >>> out, lse, mass, counts = decode_rows(
    ...     np.ones((1, 1, 2), np.float32), z, z, np.zeros(1, np.int64),
    ...     np.zeros((1, 1), np.int64), np.zeros((1, 0), np.int64),
    ...     np.zeros((1, 0, 2), np.float32), np.zeros((1, 0), np.float32),
    ...     np.zeros((1, 0, 2), np.float32), np.eye(2, dtype=np.float32),
    ...     np.eye(2, dtype=np.float32), np.zeros(1, np.int64), np.full(1, 2),
    ...     np.zeros(1, np.int64), np.zeros(1, np.int64), scale=1.0, weight=0.0,
    ...     softcap=None)
    >>> out.round(4).tolist(), counts.tolist()  # two equal scores: the mean of two rows
    ([[[0.5, 0.5]]], [[2, 0, 0]])
    """
    rows, G, D = q.shape
    out = np.empty((rows, G, D), np.float32)
    lse = np.empty((rows, G), np.float32)
    mass = np.empty((rows, G), np.float32)
    counts = np.empty((rows, 3), np.int64)
    _decode(q, keys, values, kv_base, offsets, sizes, centroids, radii, value_sums,
            steady_keys, steady_values, steady_base, steady_len, retrieve, estimate,
            float(scale), float(weight), float(softcap or 0.0), out, lse, mass, counts)
    return out, lse, mass, counts
