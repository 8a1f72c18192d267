"""Triton kernels of the wave executor's decode step (one query token per sequence).

1. ``rank_and_select`` — centroid logits of the G query heads of each (sequence, KV head)
   row (one ``tl.dot`` per tile), the GQA-summed softmax score fused with the first radix
   pass, then the ``k1``-th and ``k2``-th largest scores by a 4-bit radix select over all
   (row, chunk) programs (no sort), per-chunk counts, one scan per row, and a parallel write
   that marks each cluster retrieved (rank < k1), estimated (k1 <= rank < k2) or dropped and
   compacts the retrieved ids with their first row and the running sum of their sizes. Ties
   rank by cluster id, so the zones are those of a stable top-k. A row map (execution
   position -> KV row) lets the retrieved rows be read in place.
2. ``attend_retrieved`` / ``attend_steady`` / ``attend_estimated`` — split-K flash decoding over
   the retrieved rows (in place through the row map, or from a contiguous execution buffer),
   over the steady zone, and over the estimated clusters (centroid logits plus log size,
   value means). Each split writes a partial ``(out, lse)``.
3. ``combine`` merges every split of a query row by log-sum-exp.

``copy_clusters`` moves whole clusters between the KV rows, the execution buffer and the
block cache (:class:`vecstore.buffer.WaveBuffer`).

Rows are ``b * Hkv + h``; query rows ``(b * Hkv + h) * G + g`` (``[B, Hq]`` flattened).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from vecstore.kernels._backend import LazyKernel, needs_f32_dot

if TYPE_CHECKING:
    from vecstore.executor.wave_exec import Zones

__all__ = [
    "select_zones",
    "retrieved_layout",
    "steady_splits",
    "estimate_layout",
    "combine",
    "attend_retrieved",
    "attend_steady",
    "attend_estimated",
    "copy_clusters",
    "rank_and_select",
    "RETRIEVED_SPLIT",
    "STEADY_SPLIT",
    "ESTIMATE_SPLIT",
]

_SELECT_BLOCK = 1024
RETRIEVED_SPLIT = 256
STEADY_SPLIT = 256
ESTIMATE_SPLIT = 512
_BLOCK_N = 64
_BLOCK_E = 64
_BLOCK_LOGITS = 64


def _logits_kernel(
    q_ptr, c_ptr, n_ptr, logits_ptr, pmax_ptr, psum_ptr, C, split_len, num_splits, scale,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # logits of the G query heads of a row against a split of its centroids (each centroid
    # read once per group), -inf for empty clusters, and each head's max and sum of exp
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < G
    qrows = row * G + offs_g
    q = tl.load(q_ptr + qrows[:, None] * D + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK_G], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, C)
    for c0 in range(start, end, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_mask = offs_c < end
        cent = tl.load(c_ptr + (row * C + offs_c)[:, None] * D + offs_d[None, :],
                       mask=c_mask[:, None], other=0.0)
        if DOT_F32:
            cent = cent.to(tl.float32)
        n = tl.load(n_ptr + row * C + offs_c, mask=c_mask, other=0)
        lg = tl.dot(q, tl.trans(cent)) * scale
        lg = tl.where((n > 0)[None, :], lg, float("-inf"))
        tl.store(logits_ptr + qrows[:, None] * C + offs_c[None, :], lg,
                 mask=g_mask[:, None] & c_mask[None, :])
        m_new = tl.maximum(m_i, tl.max(lg, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_i = s_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(lg - m_safe[:, None]), axis=1)
        m_i = m_new
    tl.store(pmax_ptr + qrows * num_splits + split, m_i, mask=g_mask)
    tl.store(psum_ptr + qrows * num_splits + split, s_i, mask=g_mask)


def _score_kernel(
    logits_ptr, pmax_ptr, psum_ptr, score_ptr, counts_ptr, C, num_splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr,
):
    # ranking score sum_g softmax_g(logits)_j of a chunk, then the first radix pass over it
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    g_mask = offs_g < G
    qrows = row * G + offs_g
    sm = g_mask[:, None] & (offs_s < num_splits)[None, :]
    pm = tl.load(pmax_ptr + qrows[:, None] * num_splits + offs_s[None, :], mask=sm,
                 other=float("-inf"))
    ps = tl.load(psum_ptr + qrows[:, None] * num_splits + offs_s[None, :], mask=sm, other=0.0)
    m = tl.max(pm, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    z = tl.sum(ps * tl.exp(pm - m[:, None]), axis=1)
    inv_z = 1.0 / tl.where(z > 0, z, 1.0)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = idx < C
    lg = tl.load(logits_ptr + qrows[:, None] * C + idx[None, :],
                 mask=g_mask[:, None] & valid[None, :], other=float("-inf"))
    sc = tl.sum(tl.exp(lg - m[:, None]) * inv_z[:, None], axis=0)
    sc = tl.where(tl.max(lg, axis=0) > float("-inf"), sc, float("-inf"))
    tl.store(score_ptr + row * C + idx, sc, mask=valid)
    digits = tl.arange(0, 16)
    cand = digits.to(tl.uint32) << 28  # the first pass: no prefix yet, same for k1 and k2
    bits = sc.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)
    key = tl.where(valid, key, 0)
    cnt = tl.sum((key[:, None] >= cand[None, :]).to(tl.int32), axis=0)
    tl.atomic_add(counts_ptr + (row * 16 + 0) * 16 + digits, cnt)
    tl.atomic_add(counts_ptr + (row * 16 + 8) * 16 + digits, cnt)


def _radix_pass_kernel(
    score_ptr, k1_ptr, k2_ptr, counts_ptr, C,
    PASS: tl.constexpr, BLOCK: tl.constexpr,
):
    # counts[row, which, pass, d]: keys >= prefix | d << shift, summed over all chunks; the
    # prefix of this pass follows from the counts of the earlier ones (4 bits each)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    k1 = tl.load(k1_ptr + row)
    k2 = tl.load(k2_ptr + row)
    digits = tl.arange(0, 16)
    udig = digits.to(tl.uint32)
    t1 = tl.zeros([1], tl.uint32)
    t2 = tl.zeros([1], tl.uint32)
    for p in tl.static_range(PASS):
        c1 = tl.load(counts_ptr + (row * 16 + p) * 16 + digits)
        c2 = tl.load(counts_ptr + (row * 16 + 8 + p) * 16 + digits)
        t1 = t1 | (tl.sum(((c1 >= k1) & (digits > 0)).to(tl.uint32), axis=0) << (28 - 4 * p))
        t2 = t2 | (tl.sum(((c2 >= k2) & (digits > 0)).to(tl.uint32), axis=0) << (28 - 4 * p))
    cand1 = t1 | (udig << (28 - 4 * PASS))
    cand2 = t2 | (udig << (28 - 4 * PASS))
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(score_ptr + row * C + idx, mask=idx < C, other=float("nan"))
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)
    key = tl.where(idx < C, key, 0)
    cnt1 = tl.sum((key[:, None] >= cand1[None, :]).to(tl.int32), axis=0)
    cnt2 = tl.sum((key[:, None] >= cand2[None, :]).to(tl.int32), axis=0)
    tl.atomic_add(counts_ptr + (row * 16 + PASS) * 16 + digits, cnt1)
    tl.atomic_add(counts_ptr + (row * 16 + 8 + PASS) * 16 + digits, cnt2)


def _zone_stats_kernel(
    score_ptr, sizes_ptr, k1_ptr, k2_ptr, counts_ptr, stats_ptr, C, NCHUNK,
    BLOCK: tl.constexpr,
):
    # per chunk: [gt1, gt1 real, eq1, eq1 real, size gt1 real, size eq1 real, gt2, eq2]
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    k1 = tl.load(k1_ptr + row)
    k2 = tl.load(k2_ptr + row)
    digits = tl.arange(0, 16)
    t1 = tl.zeros([1], tl.uint32)
    t2 = tl.zeros([1], tl.uint32)
    for p in tl.static_range(8):
        c1 = tl.load(counts_ptr + (row * 16 + p) * 16 + digits)
        c2 = tl.load(counts_ptr + (row * 16 + 8 + p) * 16 + digits)
        t1 = t1 | (tl.sum(((c1 >= k1) & (digits > 0)).to(tl.uint32), axis=0) << (28 - 4 * p))
        t2 = t2 | (tl.sum(((c2 >= k2) & (digits > 0)).to(tl.uint32), axis=0) << (28 - 4 * p))
    th1 = tl.sum(t1, axis=0)
    th2 = tl.sum(t2, axis=0)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = idx < C
    s = tl.load(score_ptr + row * C + idx, mask=valid, other=float("nan"))
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)
    key = tl.where(valid, key, 0)
    size = tl.load(sizes_ptr + row * C + idx, mask=valid, other=0)
    real = valid & (size > 0)
    gt1 = (key > th1) & valid
    eq1 = (key == th1) & valid
    out = stats_ptr + (row * NCHUNK + chunk) * 8
    tl.store(out + 0, tl.sum(gt1.to(tl.int32), axis=0))
    tl.store(out + 1, tl.sum((gt1 & real).to(tl.int32), axis=0))
    tl.store(out + 2, tl.sum(eq1.to(tl.int32), axis=0))
    tl.store(out + 3, tl.sum((eq1 & real).to(tl.int32), axis=0))
    tl.store(out + 4, tl.sum(tl.where(gt1 & real, size, 0), axis=0))
    tl.store(out + 5, tl.sum(tl.where(eq1 & real, size, 0), axis=0))
    tl.store(out + 6, tl.sum(((key > th2) & valid).to(tl.int32), axis=0))
    tl.store(out + 7, tl.sum(((key == th2) & valid).to(tl.int32), axis=0))


def _zone_scan_kernel(
    score_ptr, sizes_ptr, k1_ptr, k2_ptr, counts_ptr, stats_ptr, bases_ptr, cum_ptr,
    count_ptr, C, NCHUNK, R_MAX,
    BLOCK: tl.constexpr, BLOCK_CH: tl.constexpr,
):
    # per row: where each chunk's retrieved clusters start (ids and rows), and the ranks of
    # the threshold ties before each chunk; bases[row, chunk] = [pos, rows, eq1, eq2] and
    # bases[row, NCHUNK] = [ties still to take at threshold 1 and 2, -, -]
    row = tl.program_id(0).to(tl.int64)
    k1 = tl.load(k1_ptr + row)
    digits = tl.arange(0, 16)
    t1 = tl.zeros([1], tl.uint32)
    for p in tl.static_range(8):
        c1 = tl.load(counts_ptr + (row * 16 + p) * 16 + digits)
        t1 = t1 | (tl.sum(((c1 >= k1) & (digits > 0)).to(tl.uint32), axis=0) << (28 - 4 * p))
    th1 = tl.sum(t1, axis=0)
    k2 = tl.load(k2_ptr + row)
    ch = tl.arange(0, BLOCK_CH)
    cm = ch < NCHUNK
    st = stats_ptr + (row * NCHUNK + ch) * 8
    gt1 = tl.load(st + 0, mask=cm, other=0)
    gt1r = tl.load(st + 1, mask=cm, other=0)
    eq1 = tl.load(st + 2, mask=cm, other=0)
    eq1r = tl.load(st + 3, mask=cm, other=0)
    szg = tl.load(st + 4, mask=cm, other=0)
    sze = tl.load(st + 5, mask=cm, other=0)
    gt2 = tl.load(st + 6, mask=cm, other=0)
    eq2 = tl.load(st + 7, mask=cm, other=0)
    need1 = k1 - tl.sum(gt1, axis=0)
    need2 = k2 - tl.sum(gt2, axis=0)
    eq1_before = tl.cumsum(eq1, axis=0) - eq1
    eq2_before = tl.cumsum(eq2, axis=0) - eq2
    take = tl.minimum(tl.maximum(need1 - eq1_before, 0), eq1)  # ties of the chunk taken
    tie_n = tl.where(take == eq1, eq1r, 0)
    tie_sz = tl.where(take == eq1, sze, 0)
    # at most one chunk takes part of its ties: count those in id order
    partial = cm & (take > 0) & (take < eq1)
    pc = tl.sum(tl.where(partial, ch, 0), axis=0)
    pt = tl.sum(tl.where(partial, take, 0), axis=0)
    idx = pc * BLOCK + tl.arange(0, BLOCK)
    valid = idx < C
    s = tl.load(score_ptr + row * C + idx, mask=valid, other=float("nan"))
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)
    size = tl.load(sizes_ptr + row * C + idx, mask=valid, other=0)
    e = ((key == th1) & valid).to(tl.int32)
    rank = tl.cumsum(e, axis=0) - e
    pick = (e > 0) & (rank < pt) & (size > 0)
    p_n = tl.sum(pick.to(tl.int32), axis=0)
    p_sz = tl.sum(tl.where(pick, size, 0), axis=0)
    is_pc = ch == pc
    tie_n = tl.where(is_pc & (pt > 0), p_n, tie_n)
    tie_sz = tl.where(is_pc & (pt > 0), p_sz, tie_sz)
    n_sel = gt1r + tie_n
    n_rows = szg + tie_sz
    pos = tl.cumsum(n_sel, axis=0) - n_sel
    rws = tl.cumsum(n_rows, axis=0) - n_rows
    bo = bases_ptr + (row * (NCHUNK + 1) + ch) * 4
    tl.store(bo + 0, pos, mask=cm)
    tl.store(bo + 1, rws, mask=cm)
    tl.store(bo + 2, eq1_before, mask=cm)
    tl.store(bo + 3, eq2_before, mask=cm)
    total = tl.sum(n_sel, axis=0)
    tl.store(count_ptr + row, total)
    tl.store(cum_ptr + row * (R_MAX + 1) + total, tl.sum(n_rows, axis=0))
    tl.store(bases_ptr + (row * (NCHUNK + 1) + NCHUNK) * 4 + 0, need1)
    tl.store(bases_ptr + (row * (NCHUNK + 1) + NCHUNK) * 4 + 1, need2)


def _zone_write_kernel(
    score_ptr, sizes_ptr, starts_ptr, k1_ptr, k2_ptr, counts_ptr, bases_ptr,
    zone_ptr, ids_ptr, rstart_ptr, cum_ptr,
    C, NCHUNK, R_MAX,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    k1 = tl.load(k1_ptr + row)
    k2 = tl.load(k2_ptr + row)
    digits = tl.arange(0, 16)
    t1 = tl.zeros([1], tl.uint32)
    t2 = tl.zeros([1], tl.uint32)
    for p in tl.static_range(8):
        c1 = tl.load(counts_ptr + (row * 16 + p) * 16 + digits)
        c2 = tl.load(counts_ptr + (row * 16 + 8 + p) * 16 + digits)
        t1 = t1 | (tl.sum(((c1 >= k1) & (digits > 0)).to(tl.uint32), axis=0) << (28 - 4 * p))
        t2 = t2 | (tl.sum(((c2 >= k2) & (digits > 0)).to(tl.uint32), axis=0) << (28 - 4 * p))
    th1 = tl.sum(t1, axis=0)
    th2 = tl.sum(t2, axis=0)
    bo = bases_ptr + (row * (NCHUNK + 1) + chunk) * 4
    taken = tl.load(bo + 0)
    rows_taken = tl.load(bo + 1)
    eq1_seen = tl.load(bo + 2)
    eq2_seen = tl.load(bo + 3)
    need1 = tl.load(bases_ptr + (row * (NCHUNK + 1) + NCHUNK) * 4 + 0)
    need2 = tl.load(bases_ptr + (row * (NCHUNK + 1) + NCHUNK) * 4 + 1)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = idx < C
    s = tl.load(score_ptr + row * C + idx, mask=valid, other=float("nan"))
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)
    key = tl.where(valid, key, 0)
    eq1 = ((key == th1) & valid).to(tl.int32)
    eq2 = ((key == th2) & valid).to(tl.int32)
    rank1 = tl.cumsum(eq1, axis=0) - eq1 + eq1_seen
    rank2 = tl.cumsum(eq2, axis=0) - eq2 + eq2_seen
    size = tl.load(sizes_ptr + row * C + idx, mask=valid, other=0)
    real = valid & (size > 0)  # empty clusters rank last and are never read
    sel1 = ((key > th1) | ((eq1 > 0) & (rank1 < need1))) & real
    sel2 = ((key > th2) | ((eq2 > 0) & (rank2 < need2))) & real
    zone = tl.where(sel1, 1, tl.where(sel2, 2, 0)).to(tl.int8)
    tl.store(zone_ptr + row * C + idx, zone, mask=valid)
    first = tl.load(starts_ptr + row * C + idx, mask=valid, other=0)
    s1 = sel1.to(tl.int32)
    pos = tl.cumsum(s1, axis=0) - s1 + taken
    take_size = tl.where(sel1, size, 0)
    run = tl.cumsum(take_size, axis=0) - take_size + rows_taken
    tl.store(ids_ptr + row * R_MAX + pos, idx, mask=sel1)
    tl.store(rstart_ptr + row * R_MAX + pos, first, mask=sel1)
    tl.store(cum_ptr + row * (R_MAX + 1) + pos, run, mask=sel1)


def _rowmap_kernel(cum_ptr, count_ptr, rstart_ptr, rowmap_ptr, R_MAX, M,
                   BLOCK_N: tl.constexpr):
    # execution position -> KV row, for every retrieved cluster (one program each); fusing
    # this into the zone write as a loop over cluster rows measured 150x slower on the H200
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    if i < tl.load(count_ptr + row):
        p0 = tl.load(cum_ptr + row * (R_MAX + 1) + i)
        n = tl.load(cum_ptr + row * (R_MAX + 1) + i + 1) - p0
        first = tl.load(rstart_ptr + row * R_MAX + i)
        for j in range(0, n, BLOCK_N):
            offs = j + tl.arange(0, BLOCK_N)
            tl.store(rowmap_ptr + row * M + p0 + offs, first + offs, mask=offs < n)


def _retrieved_kernel(
    q_ptr, k_ptr, v_ptr, map_ptr, cum_ptr, count_ptr,
    part_out_ptr, part_lse_ptr,
    N, M, R_MAX, scale, split_base, num_parts, split_len,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    CONTIG: tl.constexpr, DOT_F32: tl.constexpr,
):
    # execution positions [split * split_len, ...) of the row's retrieved rows: read from a
    # contiguous execution buffer (CONTIG) or, in place, through the row map
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < G
    qrows = row * G + offs_g
    q = tl.load(q_ptr + qrows[:, None] * D + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    total = tl.load(cum_ptr + row * (R_MAX + 1) + tl.load(count_ptr + row))
    p0 = split * split_len
    p1 = tl.minimum(p0 + split_len, total)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for p in range(p0, p1, BLOCK_N):
        pos = p + tl.arange(0, BLOCK_N)
        pmask = pos < p1
        if CONTIG:
            src = pos.to(tl.int64)
        else:
            src = tl.load(map_ptr + row * M + pos, mask=pmask, other=0).to(tl.int64)
        kv_off = (row * N + src)[:, None] * D + offs_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=pmask[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=pmask[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(pmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        pr = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    prow = qrows * num_parts + split_base + split
    tl.store(part_out_ptr + prow[:, None] * D + offs_d[None, :], acc / l_safe[:, None],
             mask=g_mask[:, None])
    tl.store(part_lse_ptr + prow, tl.where(has, m_i + tl.log(l_safe), float("-inf")),
             mask=g_mask)


def _steady_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, part_out_ptr, part_lse_ptr,
    H, S, scale, split_base, num_parts, split_len,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < G
    qrows = row * G + offs_g
    q = tl.load(q_ptr + qrows[:, None] * D + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    length = tl.load(len_ptr + row // H).to(tl.int32)
    p0 = split * split_len
    p1 = tl.minimum(p0 + split_len, length)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for p in range(p0, p1, BLOCK_N):
        pos = p + tl.arange(0, BLOCK_N)
        pmask = pos < p1
        kv_off = (row * S + pos)[:, None] * D + offs_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=pmask[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=pmask[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(pmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        pr = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    prow = qrows * num_parts + split_base + split
    tl.store(part_out_ptr + prow[:, None] * D + offs_d[None, :], acc / l_safe[:, None],
             mask=g_mask[:, None])
    tl.store(part_lse_ptr + prow, tl.where(has, m_i + tl.log(l_safe), float("-inf")),
             mask=g_mask)


def _estimated_kernel(
    logits_ptr, sizes_ptr, vmean_ptr, zone_ptr, part_out_ptr, part_lse_ptr,
    C, split_base, num_parts, split_len,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < G
    qrows = row * G + offs_g
    e0 = split * split_len
    e1 = tl.minimum(e0 + split_len, C)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for c in range(e0, e1, BLOCK_E):
        idx = c + tl.arange(0, BLOCK_E)
        in_range = idx < e1
        # zone, size and logits are loaded independently (all in flight at once); only the
        # value means wait for the zone
        zone = tl.load(zone_ptr + row * C + idx, mask=in_range, other=0)
        size = tl.load(sizes_ptr + row * C + idx, mask=in_range, other=0)
        lg = tl.load(logits_ptr + qrows[:, None] * C + idx[None, :],
                     mask=g_mask[:, None] & in_range[None, :], other=float("-inf"))
        use = (zone == 2) & (size > 0)
        size_f = tl.where(use, size, 1).to(tl.float32)
        lg = tl.where(use[None, :], lg, float("-inf"))
        w = lg + tl.log(size_f)[None, :]
        m_new = tl.maximum(m_i, tl.max(w, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        pr = tl.exp(w - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        vm = tl.load(vmean_ptr + (row * C + idx)[:, None] * D + offs_d[None, :],
                     mask=use[:, None], other=0.0)
        pv = pr.to(vm.dtype)
        if DOT_F32:
            pv = pv.to(tl.float32)
            vm = vm.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, vm)
        m_i = m_new
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    prow = qrows * num_parts + split_base + split
    tl.store(part_out_ptr + prow[:, None] * D + offs_d[None, :], acc / l_safe[:, None],
             mask=g_mask[:, None])
    tl.store(part_lse_ptr + prow, tl.where(has, m_i + tl.log(l_safe), float("-inf")),
             mask=g_mask)


def _copy_kernel(
    cum_ptr, count_ptr, slot_ptr, src_start_ptr,
    src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr,
    R_MAX, SRC_ROWS, DST_ROWS, SLOT_T,
    MODE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # MODE 0: misses, source rows -> execution buffer; MODE 1: hits, cache slot -> execution
    # buffer; MODE 2: admitted misses, execution buffer -> cache slot
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    count = tl.load(count_ptr + row)
    if i < count:
        slot = tl.load(slot_ptr + row * R_MAX + i)
        p0 = tl.load(cum_ptr + row * (R_MAX + 1) + i)
        n = tl.load(cum_ptr + row * (R_MAX + 1) + i + 1) - p0
        go = slot < 0 if MODE == 0 else slot >= 0
        if go:
            offs_d = tl.arange(0, D)
            if MODE == 0:
                src0 = row * SRC_ROWS + tl.load(src_start_ptr + row * R_MAX + i)
                dst0 = row * DST_ROWS + p0
            elif MODE == 1:
                src0 = (row * (SRC_ROWS // SLOT_T) + slot) * SLOT_T
                dst0 = row * DST_ROWS + p0
            else:
                src0 = row * SRC_ROWS + p0
                dst0 = (row * (DST_ROWS // SLOT_T) + slot) * SLOT_T
            for j in range(0, n, BLOCK_N):
                offs = j + tl.arange(0, BLOCK_N)
                m = offs < n
                so = (src0 + offs)[:, None] * D + offs_d[None, :]
                do = (dst0 + offs)[:, None] * D + offs_d[None, :]
                k = tl.load(src_k_ptr + so, mask=m[:, None])  # both loads in flight at once
                v = tl.load(src_v_ptr + so, mask=m[:, None])
                tl.store(dst_k_ptr + do, k, mask=m[:, None])
                tl.store(dst_v_ptr + do, v, mask=m[:, None])


def _combine_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, P,
                    D: tl.constexpr, BLOCK_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, D)
    m = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for p0 in range(0, P, BLOCK_P):
        lp = tl.load(part_lse_ptr + row * P + p0 + offs_p, mask=p0 + offs_p < P,
                     other=float("-inf"))
        m = tl.maximum(m, lp)
    mx = tl.max(m, axis=0)
    m_safe = tl.where(mx == float("-inf"), 0.0, mx)
    acc = tl.zeros([D], tl.float32)
    den = tl.zeros([BLOCK_P], tl.float32)
    for p0 in range(0, P, BLOCK_P):
        pm = p0 + offs_p < P
        lp = tl.load(part_lse_ptr + row * P + p0 + offs_p, mask=pm, other=float("-inf"))
        w = tl.exp(lp - m_safe)
        o = tl.load(part_out_ptr + (row * P + p0 + offs_p)[:, None] * D + offs_d[None, :],
                    mask=pm[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
        den += w
    total = tl.sum(den, axis=0)
    has = total > 0
    t_safe = tl.where(has, total, 1.0)
    tl.store(out_ptr + row * D + offs_d, (acc / t_safe).to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + row, tl.where(has, m_safe + tl.log(t_safe), float("-inf")))


_LOGITS = LazyKernel(_logits_kernel)
_SCORE = LazyKernel(_score_kernel)
_RADIX = LazyKernel(_radix_pass_kernel)
_STATS = LazyKernel(_zone_stats_kernel)
_SCAN = LazyKernel(_zone_scan_kernel)
_WRITE = LazyKernel(_zone_write_kernel)
_ROWMAP = LazyKernel(_rowmap_kernel)
_RETRIEVED = LazyKernel(_retrieved_kernel)
_STEADY = LazyKernel(_steady_kernel)
_ESTIMATED = LazyKernel(_estimated_kernel)
_COPY = LazyKernel(_copy_kernel)
_COMBINE = LazyKernel(_combine_kernel)


@functools.lru_cache(maxsize=8)
def _target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: a few splits, enough to exercise them
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def rank_and_select(q: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor,
                    first_row: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, scale: float,
                    logits: torch.Tensor, out: Zones, rowmap: torch.Tensor | None) -> None:
    """Score every cluster and choose the zones (RetroInfer's index probe).

    Parameters
    ----------
    q : torch.Tensor
        ``[rows * G, D]`` queries, the centroids' dtype.
    centroids : torch.Tensor
        ``[rows, C, D]``.
    sizes, first_row : torch.Tensor
        ``[rows, C]`` int32.
    k1, k2 : torch.Tensor
        ``[rows]`` int32 retrieved, and retrieved plus estimated, clusters.
    logits : torch.Tensor
        ``[rows * G, C]`` float32, written: ``scale * q . c_j``, ``-inf`` for empty clusters.
    out : Zones
        Written, as by :func:`select_zones`.
    rowmap : torch.Tensor | None
        ``[rows, M]`` int32, written if given: the KV row behind each retrieved position.
    """
    rows, num_clusters, dim = centroids.shape
    group = q.shape[0] // rows
    dev = q.device
    blocks = triton.cdiv(num_clusters, _BLOCK_LOGITS)
    splits = max(1, min(blocks, 64, triton.cdiv(_target_programs(dev), rows)))
    split_len = triton.cdiv(blocks, splits) * _BLOCK_LOGITS
    splits = triton.cdiv(num_clusters, split_len)
    pmax = torch.empty(rows * group, splits, dtype=torch.float32, device=dev)
    psum = torch.empty_like(pmax)
    block_g = max(16, triton.next_power_of_2(group))
    _LOGITS[(rows, splits)](q, centroids, sizes, logits, pmax, psum, num_clusters, split_len,
                            splits, scale, G=group, D=dim, BLOCK_G=block_g,
                            BLOCK_C=_BLOCK_LOGITS, DOT_F32=needs_f32_dot(q.dtype))
    score = torch.empty(rows, num_clusters, dtype=torch.float32, device=dev)
    block, nchunk = _select_grid(num_clusters)
    counts = torch.zeros(rows, 2, 8, 16, dtype=torch.int32, device=dev)
    _SCORE[(rows, nchunk)](logits, pmax, psum, score, counts, num_clusters, splits, G=group,
                           BLOCK_G=triton.next_power_of_2(group),
                           BLOCK_S=triton.next_power_of_2(splits), BLOCK=block)
    _finish_select(score, sizes, first_row, k1, k2, counts, 1, out, rowmap)


def select_zones(score: torch.Tensor, sizes: torch.Tensor, first_row: torch.Tensor,
                 k1: torch.Tensor, k2: torch.Tensor, out: Zones) -> None:
    """Mark the ``k1`` best clusters of each row retrieved and the next ``k2 - k1`` estimated.

    Ranks are by score, ties by cluster id (a stable top-k). Eight radix passes of 4 bits
    find both thresholds with every (row, chunk) in parallel; then per-chunk counts, one
    scan per row, and a parallel write of the zones and the compacted retrieved ids.

    Parameters
    ----------
    score : torch.Tensor
        ``[rows, C]`` float32 ranking score (higher first, ``-inf`` never taken).
    sizes, first_row : torch.Tensor
        ``[rows, C]`` int32 cluster sizes and first KV rows.
    k1, k2 : torch.Tensor
        ``[rows]`` int32, ``0 <= k1 <= k2 <= C``.
    out : Zones
        Written in place.
    """
    counts = torch.zeros(score.shape[0], 2, 8, 16, dtype=torch.int32, device=score.device)
    _finish_select(score, sizes, first_row, k1, k2, counts, 0, out, None)


def _select_grid(num_clusters: int) -> tuple[int, int]:
    block = min(_SELECT_BLOCK, max(16, triton.next_power_of_2(num_clusters)))
    return block, triton.cdiv(num_clusters, block)


def _finish_select(score: torch.Tensor, sizes: torch.Tensor, first_row: torch.Tensor,
                   k1: torch.Tensor, k2: torch.Tensor, counts: torch.Tensor, first_pass: int,
                   out: Zones, rowmap: torch.Tensor | None) -> None:
    rows, num_clusters = score.shape
    block, nchunk = _select_grid(num_clusters)
    dev = score.device
    stats = torch.empty(rows, nchunk, 8, dtype=torch.int32, device=dev)
    bases = torch.empty(rows, nchunk + 1, 4, dtype=torch.int32, device=dev)
    r_max = out.ids.shape[1]
    for p in range(first_pass, 8):
        _RADIX[(rows, nchunk)](score, k1, k2, counts, num_clusters, PASS=p, BLOCK=block)
    _STATS[(rows, nchunk)](score, sizes, k1, k2, counts, stats, num_clusters, nchunk,
                           BLOCK=block)
    _SCAN[(rows,)](score, sizes, k1, k2, counts, stats, bases, out.cum, out.count,
                   num_clusters, nchunk, r_max, BLOCK=block,
                   BLOCK_CH=max(16, triton.next_power_of_2(nchunk)))
    _WRITE[(rows, nchunk)](score, sizes, first_row, k1, k2, counts, bases, out.zone, out.ids,
                           out.first_row, out.cum, num_clusters, nchunk, r_max, BLOCK=block)
    if rowmap is not None:
        _ROWMAP[(rows, r_max)](out.cum, out.count, out.first_row, rowmap, r_max,
                               rowmap.shape[1], BLOCK_N=32)


def retrieved_layout(max_rows: int) -> tuple[int, int]:
    """``(positions per split, splits)`` of a retrieved zone of at most ``max_rows`` rows."""
    per = RETRIEVED_SPLIT
    while triton.cdiv(max_rows, per) > 64:
        per *= 2
    return per, max(1, triton.cdiv(max_rows, per))


def attend_retrieved(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, zones: Zones,
                     rowmap: torch.Tensor | None, scale: float,
                     parts: tuple[torch.Tensor, torch.Tensor], split_base: int) -> None:
    """Partial states of the retrieved rows.

    ``keys``/``values`` are ``[rows, N, D]``: with ``rowmap [rows, M]`` (from
    :func:`rank_and_select`) the KV rows themselves, read in place; without it an execution
    buffer holding cluster ``i`` of a row at ``cum[i]:cum[i + 1]``. ``q`` is
    ``[rows * G, D]``; ``parts`` the ``[rows * G, P, D]`` and ``[rows * G, P]`` float32
    partial outputs and log-sum-exps.
    """
    rows, n_rows, dim = keys.shape
    group = q.shape[0] // rows
    m = rowmap.shape[1] if rowmap is not None else n_rows
    per, num_splits = retrieved_layout(m)
    _RETRIEVED[(rows, num_splits)](
        q, keys, values, rowmap if rowmap is not None else zones.cum, zones.cum, zones.count,
        parts[0], parts[1], n_rows, m, zones.ids.shape[1], scale, split_base,
        parts[1].shape[1], per,
        G=group, D=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=_BLOCK_N,
        CONTIG=rowmap is None, DOT_F32=needs_f32_dot(keys.dtype),
    )


def steady_splits(capacity: int) -> int:
    """Splits of a steady zone of at most ``capacity`` rows."""
    return max(1, triton.cdiv(capacity, STEADY_SPLIT))


def attend_steady(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  lengths: torch.Tensor, scale: float,
                  parts: tuple[torch.Tensor, torch.Tensor], split_base: int) -> None:
    """Partial states of the steady zone ``keys``/``values`` ``[B, Hkv, S, D]`` (valid rows
    ``lengths [B]``)."""
    batch, heads, cap, dim = keys.shape
    rows = batch * heads
    group = q.shape[0] // rows
    _STEADY[(rows, steady_splits(cap))](
        q, keys, values, lengths, parts[0], parts[1], heads, cap, scale, split_base,
        parts[1].shape[1], STEADY_SPLIT,
        G=group, D=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=_BLOCK_N,
        DOT_F32=needs_f32_dot(keys.dtype),
    )


def estimate_layout(num_clusters: int) -> tuple[int, int]:
    """``(clusters per split, splits)`` of the estimation zone over ``num_clusters``."""
    per = max(ESTIMATE_SPLIT, triton.cdiv(triton.cdiv(num_clusters, 32), _BLOCK_E) * _BLOCK_E)
    return per, max(1, triton.cdiv(num_clusters, per))


def attend_estimated(logits: torch.Tensor, sizes: torch.Tensor, vmean: torch.Tensor,
                     zone: torch.Tensor, parts: tuple[torch.Tensor, torch.Tensor],
                     split_base: int) -> None:
    """Partial states of the clusters marked estimated: logits ``[rows * G, C]`` float32,
    sizes ``[rows, C]`` int32, value means ``vmean [rows, C, D]``."""
    rows, num_clusters, dim = vmean.shape
    group = logits.shape[0] // rows
    per, num_splits = estimate_layout(num_clusters)
    _ESTIMATED[(rows, num_splits)](
        logits, sizes, vmean, zone, parts[0], parts[1], num_clusters, split_base,
        parts[1].shape[1], per,
        G=group, D=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_E=_BLOCK_E,
        DOT_F32=needs_f32_dot(vmean.dtype),
    )


def combine(parts: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor,
            lse: torch.Tensor) -> None:
    """Merge every partial state of a query row: ``out [rows * G, D]`` (any float dtype) and
    ``lse [rows * G]`` float32, written in place."""
    qrows, num_parts, dim = parts[0].shape
    _COMBINE[(qrows,)](parts[0], parts[1], out, lse, num_parts, D=dim, BLOCK_P=16)


def copy_clusters(mode: int, zones: Zones, slot: torch.Tensor, src_k: torch.Tensor,
                  src_v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor,
                  slot_tokens: int) -> None:
    """Move whole retrieved clusters between the tiers, one program per cluster.

    ``mode`` 0 copies misses (``slot < 0``) from the KV rows ``src [rows, N, D]`` (GPU or
    pinned host memory, read zero-copy) to the execution buffer ``dst [rows, M, D]``; 1
    copies hits (``slot >= 0``) from the cache ``src [rows, S * T, D]`` to the execution
    buffer; 2 copies clusters given a slot from the execution buffer ``src`` to the cache
    ``dst``. ``slot`` is ``[rows, R]`` int32.
    """
    rows, r_max = zones.ids.shape
    _COPY[(rows, r_max)](
        zones.cum, zones.count, slot, zones.first_row, src_k, src_v, dst_k, dst_v,
        r_max, src_k.shape[1], dst_k.shape[1], slot_tokens,
        MODE=mode, D=src_k.shape[2], BLOCK_N=32,
    )
