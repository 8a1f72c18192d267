"""Split-K attention over the retrieved zone: every row of the retrieved clusters, exactly.

The rows are read in place from the KV rows, the kernel finding each retrieved position's
row from the zones of :func:`vecstore.kernels.zone_select.select_ranked` (its cluster ``i``
by ``cum``, then ``first_row[i]`` plus its offset in the cluster), or from a contiguous
execution buffer (an offloaded view's, :class:`vecstore.buffer.WaveBuffer`). Each split writes
a partial ``(out, lse)``; :func:`vecstore.kernels.merge_parts.combine` merges them. With
``SOFTCAP`` the scores are soft-capped, ``softcap * tanh(s / softcap)`` (Gemma 2); without it
the kernel compiles as before.

Rows are ``b * Hkv + h``; query rows ``(b * Hkv + h) * G + g`` (``[B, Hq]`` flattened).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecstore.kernels._device import (
    attend_rows,
    empty_state,
    load_queries,
    query_group,
    store_state,
)
from vecstore.kernels.backend import LazyKernel, needs_f32_dot, row_stride
from vecstore.kernels.zones import Zones

__all__ = ["RETRIEVED_SPLIT", "retrieved_layout", "attend_retrieved"]

# rows (clusters) per split; larger splits measured 11 us faster than 256 / 128 at 8 x 128K on
# the H200 (fewer partial states to write and merge), the same at 4 x 1M. The splits a zone
# of at most max_rows rows gets; each row's rows spread evenly over them (H200, whole steps
# against 512 rows a split: 8 x 128K 0.142 against 0.145 ms, 8 x 512K 0.375 / 0.376, 4 x 1M
# 0.369 / 0.370, 8 x 1M 0.679 / 0.677; 256-row splits no faster)
RETRIEVED_SPLIT = 512
_BLOCK_N = 64


@triton.jit
def _cluster_of(cum_row, count, p):
    # the retrieved cluster c of execution position p: cum[c] <= p < cum[c + 1], by a binary
    # search over cum[0..count] (0 <= p < cum[count]); once per program, so a plain loop
    lo = tl.full([], 0, tl.int32)
    hi = count
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = tl.load(cum_row + mid) <= p
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def _kv_rows(cum_row, first_row, count, c, p, pos, pmask, BLOCK_N: tl.constexpr):
    # the KV row of each position pos = p + 0..BLOCK_N-1 (valid where pmask), c being the
    # cluster of p, and the cluster of p + BLOCK_N. Retrieved clusters are never empty, so
    # cum rises by at least 1 a cluster and the BLOCK_N positions from p lie in clusters
    # c..c+BLOCK_N-1, p + BLOCK_N in c..c+BLOCK_N: a lane's cluster is c plus how many of
    # cum[c+1..c+BLOCK_N] are <= its position (branch-free, one [BLOCK_N, BLOCK_N] compare;
    # entries past count, unwritten, read as above every position)
    w = c + 1 + tl.arange(0, BLOCK_N)
    bound = tl.load(cum_row + w, mask=w <= count, other=2147483647)
    i = c + tl.sum((bound[None, :] <= pos[:, None]).to(tl.int32), axis=1)
    first = tl.load(first_row + i, mask=pmask, other=0)
    begin = tl.load(cum_row + i, mask=pmask, other=0)
    nxt = c + tl.sum((bound <= p + BLOCK_N).to(tl.int32), axis=0)
    return (first + (pos - begin)).to(tl.int64), nxt


def _retrieved_kernel(
    q_ptr, k_ptr, v_ptr, cum_ptr, first_ptr, count_ptr, span_ptr,
    part_out_ptr, part_lse_ptr,
    N, R_MAX, scale, softcap, split_base, num_parts,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    CONTIG: tl.constexpr, SPAN: tl.constexpr, DOT_F32: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # split `split` of the row's retrieved rows, read from a contiguous execution buffer
    # (CONTIG) or, in place, from the KV row each position's cluster puts it at (first_row[i]
    # + pos - cum[i]). SPAN 0: all of them; 1: positions [0, span), 2: [span, total); spread
    # evenly over the row's splits. In place, the cluster of the split's first position is
    # searched for once (_cluster_of); each block of BLOCK_N positions then finds its lanes'
    # clusters among the next BLOCK_N with one contiguous load and carries the next block's
    # on (_kv_rows): a search per lane would chain log2(count) dependent gathers per block
    # before its KV rows could be loaded
    row, split, offs_d, qrows, g_mask = query_group(G, BLOCK_G, D)
    q = load_queries(q_ptr, qrows, offs_d, g_mask[:, None], D, DOT_F32)
    cum_row = cum_ptr + row * (R_MAX + 1)
    count = tl.load(count_ptr + row)
    stop = tl.load(cum_row + count)
    start = 0
    if SPAN == 1:
        stop = tl.load(span_ptr + row)
    elif SPAN == 2:
        start = tl.load(span_ptr + row)
    per = tl.cdiv(tl.cdiv(stop - start, tl.num_programs(1)), BLOCK_N) * BLOCK_N
    p0 = start + split * per
    p1 = tl.minimum(p0 + per, stop)
    m_i, l_i, acc = empty_state(BLOCK_G, D)
    if not CONTIG:
        c = _cluster_of(cum_row, count, p0)
    for p in range(p0, p1, BLOCK_N):
        pos = p + tl.arange(0, BLOCK_N)
        pmask = pos < p1
        if CONTIG:
            src = pos.to(tl.int64)
        else:
            src, c = _kv_rows(cum_row, first_ptr + row * R_MAX, count, c, p, pos, pmask,
                              BLOCK_N)
        kv_off = (row * N + src)[:, None] * D + offs_d[None, :]
        m_i, l_i, acc = attend_rows(q, k_ptr, v_ptr, kv_off, pmask, scale, softcap, m_i, l_i,
                                    acc, DOT_F32, SOFTCAP)
    store_state(part_out_ptr, part_lse_ptr, qrows, g_mask, g_mask[:, None], offs_d,
                split_base + split, num_parts, m_i, l_i, acc, D)


_RETRIEVED = LazyKernel(_retrieved_kernel)


def retrieved_layout(max_rows: int) -> tuple[int, int]:
    """``(nominal positions per split, splits)`` of a retrieved zone of at most ``max_rows``
    rows (the kernel spreads each row's rows evenly over the splits)."""
    per = RETRIEVED_SPLIT
    while triton.cdiv(max_rows, per) > 64:
        per *= 2
    return per, max(1, triton.cdiv(max_rows, per))


def attend_retrieved(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, zones: Zones,
                     max_rows: int | None, scale: float,
                     parts: tuple[torch.Tensor, torch.Tensor], split_base: int, *,
                     split: torch.Tensor | None = None, after_split: bool = False,
                     softcap: float | None = None) -> None:
    """Partial states of the retrieved rows.

    ``keys``/``values`` are ``[rows, N, D]`` (each row's ``[N, D]`` contiguous; rows may sit
    further apart, :func:`~vecstore.kernels.backend.row_stride`): with ``max_rows`` (at least
    every row's ``cum[count]``) the KV rows themselves, read in place, retrieved position
    ``cum[i] + j`` of a row being its KV row ``first_row[i] + j``; with ``None`` an execution
    buffer holding a row's ``cum[count]`` retrieved rows contiguously. With ``split [rows]``
    int32 only positions ``0:split`` of each row (or ``split:cum[count]`` if
    ``after_split``), spread evenly over the splits. ``q`` is ``[rows * G, D]``;
    ``parts`` the ``[rows * G, P, D]`` and ``[rows * G, P]`` float32 partial outputs and
    log-sum-exps, of which this writes ``retrieved_layout(max_rows or N)[1]`` from
    ``split_base`` on. ``softcap`` soft-caps the scores (``None``: no cap).
    """
    rows, n_rows, dim = keys.shape
    group = q.shape[0] // rows
    _, num_splits = retrieved_layout(max_rows if max_rows is not None else n_rows)
    _RETRIEVED[(rows, num_splits)](
        q, keys, values, zones.cum, zones.first_row, zones.count,
        split if split is not None else zones.count, parts[0], parts[1],
        row_stride(keys, values), zones.ids.shape[1], scale, softcap or 1.0, split_base,
        parts[1].shape[1],
        G=group, D=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=_BLOCK_N,
        CONTIG=max_rows is None, SPAN=0 if split is None else 2 if after_split else 1,
        DOT_F32=needs_f32_dot(keys.dtype), SOFTCAP=softcap is not None,
    )
