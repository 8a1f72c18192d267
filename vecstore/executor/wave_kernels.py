"""Triton kernels of the wave executor's decode step (one query token per sequence).

The step after centroid scoring (:func:`vecstore.kernels._centroid_kernels.group_scores_triton`):

1. ``select_zones`` — per (sequence, KV head) row, the ``k1``-th and ``k2``-th largest ranking
   scores by a 4-bit radix select (no sort), then one pass in cluster order that marks each
   cluster retrieved (rank < k1), estimated (k1 <= rank < k2) or dropped, and compacts the
   retrieved ids with their first row and the running sum of their sizes. Ties rank by cluster
   id, so the zones are those of a stable top-k.
2. ``attend_retrieved`` / ``attend_steady`` / ``attend_estimated`` — split-K flash decoding over
   the retrieved rows (read in place by a binary search over the running sizes, or from a
   contiguous execution buffer), over the steady zone, and over the estimated clusters
   (centroid logits plus log size, value means). Each split writes a partial ``(out, lse)``.
3. :func:`vecstore.kernels._split.combine_splits` merges every split of a row by log-sum-exp.

Rows are ``b * Hkv + h``; query rows ``(b * Hkv + h) * G + g`` (``[B, Hq]`` flattened).
"""

from __future__ import annotations

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
    "CLUSTERS_PER_SPLIT",
    "STEADY_SPLIT",
    "ESTIMATE_SPLIT",
]

_SELECT_BLOCK = 1024
CLUSTERS_PER_SPLIT = 16
_LOG_CPS = 4  # binary-search steps over CLUSTERS_PER_SPLIT running sizes
STEADY_SPLIT = 256
ESTIMATE_SPLIT = 512
_BLOCK_N = 64
_BLOCK_E = 64


def _select_kernel(
    score_ptr, sizes_ptr, starts_ptr, k1_ptr, k2_ptr,
    zone_ptr, ids_ptr, rstart_ptr, cum_ptr, count_ptr,
    C, R_MAX,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    k1 = tl.load(k1_ptr + row)
    k2 = tl.load(k2_ptr + row)
    base = row * C
    offs = tl.arange(0, BLOCK)
    digits = tl.arange(0, 16).to(tl.uint32)
    t1 = tl.zeros([1], tl.uint32)
    t2 = tl.zeros([1], tl.uint32)
    # radix select, 4 bits a pass: after the pass at `shift`, t is the largest prefix
    # such that at least k keys are >= t; at the end t is the k-th largest key
    for p in tl.static_range(8):
        shift = 28 - 4 * p
        cand1 = t1 | (digits << shift)  # [16]
        cand2 = t2 | (digits << shift)
        cnt1 = tl.zeros([16], tl.int32)
        cnt2 = tl.zeros([16], tl.int32)
        for c0 in range(0, C, BLOCK):
            idx = c0 + offs
            s = tl.load(score_ptr + base + idx, mask=idx < C, other=float("nan"))
            bits = s.to(tl.int32, bitcast=True)
            key = tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)
            key = tl.where(idx < C, key, 0)
            cnt1 += tl.sum((key[:, None] >= cand1[None, :]).to(tl.int32), axis=0)
            cnt2 += tl.sum((key[:, None] >= cand2[None, :]).to(tl.int32), axis=0)
        d1 = tl.sum(((cnt1 >= k1) & (digits > 0)).to(tl.uint32), axis=0)
        d2 = tl.sum(((cnt2 >= k2) & (digits > 0)).to(tl.uint32), axis=0)
        t1 = t1 | (d1 << shift)
        t2 = t2 | (d2 << shift)
    th1 = tl.sum(t1, axis=0)
    th2 = tl.sum(t2, axis=0)
    gt1 = 0
    gt2 = 0
    for c0 in range(0, C, BLOCK):
        idx = c0 + offs
        s = tl.load(score_ptr + base + idx, mask=idx < C, other=float("nan"))
        bits = s.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)
        key = tl.where(idx < C, key, 0)
        gt1 += tl.sum((key > th1).to(tl.int32), axis=0)
        gt2 += tl.sum((key > th2).to(tl.int32), axis=0)
    need1 = k1 - gt1  # ties at the threshold still to take, lowest id first
    need2 = k2 - gt2
    eq1_seen = 0
    eq2_seen = 0
    taken = 0
    rows_taken = 0
    for c0 in range(0, C, BLOCK):
        idx = c0 + offs
        valid = idx < C
        s = tl.load(score_ptr + base + idx, mask=valid, other=float("nan"))
        bits = s.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)
        key = tl.where(valid, key, 0)
        eq1 = ((key == th1) & valid).to(tl.int32)
        eq2 = ((key == th2) & valid).to(tl.int32)
        rank1 = tl.cumsum(eq1, axis=0) - eq1 + eq1_seen
        rank2 = tl.cumsum(eq2, axis=0) - eq2 + eq2_seen
        size = tl.load(sizes_ptr + base + idx, mask=valid, other=0)
        real = valid & (size > 0)  # empty clusters rank last and are never read
        sel1 = ((key > th1) | ((eq1 > 0) & (rank1 < need1))) & real
        sel2 = ((key > th2) | ((eq2 > 0) & (rank2 < need2))) & real
        zone = tl.where(sel1, 1, tl.where(sel2, 2, 0)).to(tl.int8)
        tl.store(zone_ptr + base + idx, zone, mask=valid)
        first = tl.load(starts_ptr + base + idx, mask=valid, other=0)
        s1 = sel1.to(tl.int32)
        pos = tl.cumsum(s1, axis=0) - s1 + taken
        take_size = tl.where(sel1, size, 0)
        run = tl.cumsum(take_size, axis=0) - take_size + rows_taken
        out = row * (R_MAX + 1) + pos
        tl.store(ids_ptr + row * R_MAX + pos, idx, mask=sel1)
        tl.store(rstart_ptr + row * R_MAX + pos, first, mask=sel1)
        tl.store(cum_ptr + out, run, mask=sel1)
        eq1_seen += tl.sum(eq1, axis=0)
        eq2_seen += tl.sum(eq2, axis=0)
        taken += tl.sum(s1, axis=0)
        rows_taken += tl.sum(take_size, axis=0)
    tl.store(cum_ptr + row * (R_MAX + 1) + taken, rows_taken)
    tl.store(count_ptr + row, taken)


def _retrieved_kernel(
    q_ptr, k_ptr, v_ptr, rstart_ptr, cum_ptr, count_ptr,
    part_out_ptr, part_lse_ptr,
    N, R_MAX, scale, split_base, num_parts,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    CPS: tl.constexpr, LOG_CPS: tl.constexpr, CONTIG: tl.constexpr, DOT_F32: tl.constexpr,
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
    count = tl.load(count_ptr + row)
    c0 = split * CPS
    c1 = tl.minimum(c0 + CPS, count)
    cbase = row * (R_MAX + 1)
    p0 = tl.load(cum_ptr + cbase + tl.minimum(c0, count))
    p1 = tl.load(cum_ptr + cbase + tl.maximum(c1, tl.minimum(c0, count)))
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for p in range(p0, p1, BLOCK_N):
        pos = p + tl.arange(0, BLOCK_N)
        pmask = pos < p1
        if CONTIG:
            src = pos.to(tl.int64)
        else:
            lo = tl.zeros([BLOCK_N], tl.int32) + c0
            hi = tl.zeros([BLOCK_N], tl.int32) + c1
            for _ in tl.static_range(LOG_CPS):
                mid = (lo + hi) // 2
                at = tl.load(cum_ptr + cbase + mid, mask=pmask, other=0)
                go = at <= pos
                lo = tl.where(go, mid, lo)
                hi = tl.where(go, hi, mid)
            first = tl.load(rstart_ptr + row * R_MAX + lo, mask=pmask, other=0)
            at_lo = tl.load(cum_ptr + cbase + lo, mask=pmask, other=0)
            src = (first + pos - at_lo).to(tl.int64)
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
        zone = tl.load(zone_ptr + row * C + idx, mask=in_range, other=0)
        size = tl.load(sizes_ptr + row * C + idx, mask=in_range, other=0)
        use = (zone == 2) & (size > 0)
        size_f = tl.where(use, size, 1).to(tl.float32)
        lg = tl.load(logits_ptr + qrows[:, None] * C + idx[None, :],
                     mask=g_mask[:, None] & use[None, :], other=float("-inf"))
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
                tl.store(dst_k_ptr + do, tl.load(src_k_ptr + so, mask=m[:, None]), mask=m[:, None])
                tl.store(dst_v_ptr + do, tl.load(src_v_ptr + so, mask=m[:, None]), mask=m[:, None])


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


_SELECT = LazyKernel(_select_kernel)
_RETRIEVED = LazyKernel(_retrieved_kernel)
_STEADY = LazyKernel(_steady_kernel)
_ESTIMATED = LazyKernel(_estimated_kernel)
_COPY = LazyKernel(_copy_kernel)
_COMBINE = LazyKernel(_combine_kernel)


def select_zones(score: torch.Tensor, sizes: torch.Tensor, first_row: torch.Tensor,
                 k1: torch.Tensor, k2: torch.Tensor, out: Zones) -> None:
    """Mark the ``k1`` best clusters of each row retrieved and the next ``k2 - k1`` estimated.

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
    rows, num_clusters = score.shape
    _SELECT[(rows,)](score, sizes, first_row, k1, k2, out.zone, out.ids, out.first_row,
                     out.cum, out.count, num_clusters, out.ids.shape[1],
                     BLOCK=min(_SELECT_BLOCK, max(16, triton.next_power_of_2(num_clusters))))


def retrieved_layout(r_max: int) -> tuple[int, int]:
    """``(clusters per split, splits)`` of the retrieved zone for at most ``r_max`` clusters."""
    cps = CLUSTERS_PER_SPLIT
    while triton.cdiv(r_max, cps) > 32:
        cps *= 2
    return cps, max(1, triton.cdiv(r_max, cps))


def attend_retrieved(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, zones: Zones,
                     scale: float, parts: tuple[torch.Tensor, torch.Tensor], split_base: int,
                     *, contiguous: bool) -> None:
    """Partial states of the retrieved rows.

    ``keys``/``values`` are ``[rows, N, D]``: the KV rows themselves (read at each cluster's
    first row) or, with ``contiguous``, an execution buffer holding cluster ``i`` of a row at
    ``cum[i]:cum[i + 1]``. ``q`` is ``[rows * G, D]``; ``parts`` the ``[rows * G, P, D]`` and
    ``[rows * G, P]`` float32 partial outputs and log-sum-exps.
    """
    rows, n_rows, dim = keys.shape
    group = q.shape[0] // rows
    r_max = zones.ids.shape[1]
    cps, num_splits = retrieved_layout(r_max)
    _RETRIEVED[(rows, num_splits)](
        q, keys, values, zones.first_row, zones.cum, zones.count, parts[0], parts[1],
        n_rows, r_max, scale, split_base, parts[1].shape[1],
        G=group, D=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=_BLOCK_N,
        CPS=cps, LOG_CPS=cps.bit_length() - 1, CONTIG=contiguous,
        DOT_F32=needs_f32_dot(keys.dtype),
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
