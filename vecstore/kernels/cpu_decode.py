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
rows a tier keeps a reserve apart are read where they are (:mod:`~vecstore.kernels.cpu_rows`:
row access, bfloat16 widened as read); the zones come from
:mod:`~vecstore.kernels.cpu_zones`.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from vecstore.kernels.cpu_rows import FAST, axpy, cap, dot, score_rows, weigh_rows
from vecstore.kernels.cpu_zones import rank_keys, split_zones

__all__ = ["decode_rows"]

_Array = npt.NDArray[Any]


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=FAST)
def _decode(q: _Array, keys: _Array, values: _Array, kv_base: _Array, offsets: _Array,
            sizes: _Array, centroids: _Array, radii: _Array, value_sums: _Array,
            steady_keys: _Array, steady_values: _Array, steady_base: _Array,
            steady_len: _Array, retrieve: _Array, estimate: _Array, scale: float,
            weight: float, softcap: float, out: _Array, lse: _Array, mass: _Array,
            counts: _Array) -> None:
    rows, G, D = q.shape
    for i in numba.prange(rows):
        key = rank_keys(q[i], sizes[i], centroids[i], radii[i], scale, weight)
        valid = 0
        for c in range(sizes.shape[1]):
            valid += sizes[i, c] > 0
        r = min(retrieve[i], valid)
        e = min(estimate[i], valid - r)
        ret, est = split_zones(key, r, e)
        exact = steady_len[i]
        for j in range(r):
            exact += sizes[i, ret[j]]
        counts[i, 0], counts[i, 1], counts[i, 2] = exact, r, e
        bits = np.empty(D, np.uint32)
        wide = bits.view(np.float32)
        logits = np.empty((G, exact + e), np.float32)
        # scores: steady rows, retrieved rows, estimated clusters (+ log size)
        pos = score_rows(q[i], steady_keys, steady_base[i], steady_len[i], scale, softcap,
                          logits, 0, bits, wide)
        for j in range(r):
            c = ret[j]
            pos = score_rows(q[i], keys, kv_base[i] + offsets[i, c], sizes[i, c], scale,
                              softcap, logits, pos, bits, wide)
        for j in range(e):
            c = est[j]
            log_n = math.log(np.float32(sizes[i, c]))
            for g in range(G):
                logits[g, pos + j] = cap(dot(q[i, g], centroids[i, c]) * scale,
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
        pos = weigh_rows(logits, steady_values, steady_base[i], steady_len[i], acc, 0, bits,
                          wide)
        for j in range(r):
            c = ret[j]
            pos = weigh_rows(logits, values, kv_base[i] + offsets[i, c], sizes[i, c], acc, pos,
                              bits, wide)
        for j in range(e):
            c = est[j]
            inv_n = np.float32(1.0) / np.float32(sizes[i, c])
            for g in range(G):
                axpy(logits[g, pos + j] * inv_n, value_sums[i, c], acc[g])
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
