"""Triton kernels of the wave executor's index probe: rank every cluster, choose the zones.

``rank_and_select`` — centroid logits of the G query heads of each (sequence, KV head) row
(one ``tl.dot`` per tile, each centroid read once per group), the GQA-summed softmax score
fused with the first radix pass, then the ``k1``-th and ``k2``-th largest scores by a 4-bit
radix select over all (row, chunk) programs (no sort), per-chunk counts, one scan per row,
and a parallel write that marks each cluster retrieved (rank < k1), estimated
(k1 <= rank < k2) or dropped and compacts the retrieved ids with their first row and the
running sum of their sizes. Ties rank by cluster id, so the zones are those of a stable
top-k (RetroInfer's plan, :func:`vecstore.executor.plan.make_plan`). A row map (execution
position -> KV row) lets the retrieved rows be read in place.

Rows are ``b * Hkv + h``; query rows ``(b * Hkv + h) * G + g`` (``[B, Hq]`` flattened).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from vecstore.executor.wave_rank import LOGITS, SCORE
from vecstore.kernels._backend import LazyKernel, needs_f32_dot

if TYPE_CHECKING:
    from vecstore.executor.wave_state import Zones

__all__ = ["rank_and_select", "select_zones"]

_SELECT_BLOCK = 1024
_BLOCK_LOGITS = 64  # centroids per tile of the logits kernel


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


_RADIX = LazyKernel(_radix_pass_kernel)
_STATS = LazyKernel(_zone_stats_kernel)
_SCAN = LazyKernel(_zone_scan_kernel)
_WRITE = LazyKernel(_zone_write_kernel)
_ROWMAP = LazyKernel(_rowmap_kernel)


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
    LOGITS[(rows, splits)](q, centroids, sizes, logits, pmax, psum, num_clusters, split_len,
                            splits, scale, G=group, D=dim, BLOCK_G=block_g,
                            BLOCK_C=_BLOCK_LOGITS, DOT_F32=needs_f32_dot(q.dtype))
    score = torch.empty(rows, num_clusters, dtype=torch.float32, device=dev)
    block, nchunk = _select_grid(num_clusters)
    counts = torch.zeros(rows, 2, 8, 16, dtype=torch.int32, device=dev)
    SCORE[(rows, nchunk)](logits, pmax, psum, score, counts, num_clusters, splits, G=group,
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
