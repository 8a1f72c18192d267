"""The index probe's zone write: each cluster marked retrieved, estimated or dropped.

Given a row's ranking score and its two thresholds (the ``k1``-th and ``k2``-th largest
scores, :func:`vecstore.kernels.radix_select.radix_thresholds`), :func:`write_zones` runs
per-chunk counts, one scan per row, and a parallel write (one packed scan per chunk) that
marks each cluster retrieved (rank < k1), estimated (k1 <= rank < k2) or dropped, compacts
the retrieved ids with their first row and the running sum of their sizes, and the estimated
ids. Ties rank by cluster id, so the zones are those of a stable top-k (RetroInfer's plan,
:func:`vecstore.executor.plan.make_plan`).

Rows are ``b * Hkv + h``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecstore.kernels.backend import LazyKernel
from vecstore.kernels.radix_select import chained, follow, radix_keys, radix_thresholds
from vecstore.kernels.zones import Zones

__all__ = ["select_grid", "write_zones"]

_SELECT_BLOCK = 1024


@triton.jit
def _thresholds(thr_ptr, row):
    # the row's two thresholds as uint32 keys (radix_thresholds wrote their bits)
    th1 = tl.load(thr_ptr + row * 2).to(tl.uint32, bitcast=True)
    th2 = tl.load(thr_ptr + row * 2 + 1).to(tl.uint32, bitcast=True)
    return th1, th2


def _zone_stats_kernel(score_ptr, sizes_ptr, thr_ptr, stats_ptr, C, NCHUNK,
                       BLOCK: tl.constexpr, GDC: tl.constexpr):
    # per chunk, threshold w at [6w, 6w + 6): [gt, gt real, eq, eq real, rows gt real, rows eq
    # real] (real: not empty)
    follow(GDC)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    th1, th2 = _thresholds(thr_ptr, row)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = idx < C
    s = tl.load(score_ptr + row * C + idx, mask=valid, other=float("nan"))
    key = radix_keys(s)
    key = tl.where(valid, key, 0)
    size = tl.load(sizes_ptr + row * C + idx, mask=valid, other=0)
    real = valid & (size > 0)
    out = stats_ptr + (row * NCHUNK + chunk) * 12
    for w in tl.static_range(2):
        th = th1 if w == 0 else th2
        gt = (key > th) & valid
        eq = (key == th) & valid
        tl.store(out + 6 * w + 0, tl.sum(gt.to(tl.int32), axis=0))
        tl.store(out + 6 * w + 1, tl.sum((gt & real).to(tl.int32), axis=0))
        tl.store(out + 6 * w + 2, tl.sum(eq.to(tl.int32), axis=0))
        tl.store(out + 6 * w + 3, tl.sum((eq & real).to(tl.int32), axis=0))
        tl.store(out + 6 * w + 4, tl.sum(tl.where(gt & real, size, 0), axis=0))
        tl.store(out + 6 * w + 5, tl.sum(tl.where(eq & real, size, 0), axis=0))


@triton.jit
def _chunk_takes(score_ptr, sizes_ptr, stats_ptr, row, C, NCHUNK, th, k, ch, cm, w,
                 BLOCK: tl.constexpr):
    # of the k best of a row (ties in id order), the clusters and rows each chunk takes
    # (empty clusters never), how many ties rank before each chunk, and how many ties are
    # taken in all
    st = stats_ptr + (row * NCHUNK + ch) * 12 + 6 * w
    gt = tl.load(st + 0, mask=cm, other=0)
    eq = tl.load(st + 2, mask=cm, other=0)
    eqr = tl.load(st + 3, mask=cm, other=0)
    sze = tl.load(st + 5, mask=cm, other=0)
    need = k - tl.sum(gt, axis=0)
    eq_before = tl.cumsum(eq, axis=0) - eq
    take = tl.minimum(tl.maximum(need - eq_before, 0), eq)  # ties of the chunk taken
    tie_n = tl.where(take == eq, eqr, 0)
    tie_sz = tl.where(take == eq, sze, 0)
    # at most one chunk takes part of its ties: count those in id order
    partial = cm & (take > 0) & (take < eq)
    pc = tl.sum(tl.where(partial, ch, 0), axis=0)
    pt = tl.sum(tl.where(partial, take, 0), axis=0)
    idx = pc * BLOCK + tl.arange(0, BLOCK)
    valid = idx < C
    key = radix_keys(tl.load(score_ptr + row * C + idx, mask=valid, other=float("nan")))
    size = tl.load(sizes_ptr + row * C + idx, mask=valid, other=0)
    e = ((key == th) & valid).to(tl.int32)
    rank = tl.cumsum(e, axis=0) - e
    pick = (e > 0) & (rank < pt) & (size > 0)
    is_pc = (ch == pc) & (pt > 0)
    tie_n = tl.where(is_pc, tl.sum(pick.to(tl.int32), axis=0), tie_n)
    tie_sz = tl.where(is_pc, tl.sum(tl.where(pick, size, 0), axis=0), tie_sz)
    n_sel = tl.load(st + 1, mask=cm, other=0) + tie_n
    n_rows = tl.load(st + 4, mask=cm, other=0) + tie_sz
    return n_sel, n_rows, eq_before, need


def _zone_scan_kernel(
    score_ptr, sizes_ptr, k1_ptr, k2_ptr, thr_ptr, stats_ptr, bases_ptr, cum_ptr,
    count_ptr, est_count_ptr, C, NCHUNK, R_MAX,
    BLOCK: tl.constexpr, BLOCK_CH: tl.constexpr, GDC: tl.constexpr,
):
    # per row: where each chunk's retrieved clusters start (ids and rows), its estimated
    # ones, and the ranks of the threshold ties before it; bases[row, chunk] = [pos, rows,
    # eq1, eq2, estimated pos] and bases[row, NCHUNK, :2] = ties still to take at threshold
    # 1 and 2
    follow(GDC)
    row = tl.program_id(0).to(tl.int64)
    k1 = tl.load(k1_ptr + row)
    k2 = tl.load(k2_ptr + row)
    th1, th2 = _thresholds(thr_ptr, row)
    ch = tl.arange(0, BLOCK_CH)
    cm = ch < NCHUNK
    n1, r1, eq1_before, need1 = _chunk_takes(score_ptr, sizes_ptr, stats_ptr, row, C, NCHUNK,
                                             th1, k1, ch, cm, 0, BLOCK)
    n2, _, eq2_before, need2 = _chunk_takes(score_ptr, sizes_ptr, stats_ptr, row, C, NCHUNK,
                                            th2, k2, ch, cm, 1, BLOCK)
    pos = tl.cumsum(n1, axis=0) - n1
    bo = bases_ptr + (row * (NCHUNK + 1) + ch) * 5
    tl.store(bo + 0, pos, mask=cm)
    tl.store(bo + 1, tl.cumsum(r1, axis=0) - r1, mask=cm)
    tl.store(bo + 2, eq1_before, mask=cm)
    tl.store(bo + 3, eq2_before, mask=cm)
    tl.store(bo + 4, tl.cumsum(n2, axis=0) - n2 - pos, mask=cm)  # retrieved are also in n2
    total = tl.sum(n1, axis=0)
    tl.store(count_ptr + row, total)
    tl.store(est_count_ptr + row, tl.sum(n2, axis=0) - total)
    tl.store(cum_ptr + row * (R_MAX + 1) + total, tl.sum(r1, axis=0))
    last = bases_ptr + (row * (NCHUNK + 1) + NCHUNK) * 5
    tl.store(last + 0, need1)
    tl.store(last + 1, need2)


@triton.jit
def _tie_ranks(eq, seen):
    # rank of each tie (eq 1) among the row's ties: seen before the chunk, then in id order;
    # most chunks hold none, and skip the scan
    rank = tl.zeros_like(eq) + seen
    if tl.sum(eq, axis=0) > 0:
        rank = tl.cumsum(eq, axis=0) - eq + seen
    return rank


def _zone_write_kernel(
    score_ptr, sizes_ptr, starts_ptr, thr_ptr, bases_ptr,
    zone_ptr, ids_ptr, rstart_ptr, cum_ptr, est_ptr,
    C, NCHUNK, R_MAX, E_MAX,
    BLOCK: tl.constexpr, GDC: tl.constexpr,
):
    follow(GDC)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    bo = bases_ptr + (row * (NCHUNK + 1) + chunk) * 5
    taken = tl.load(bo + 0)
    rows_taken = tl.load(bo + 1)
    eq1_seen = tl.load(bo + 2)
    eq2_seen = tl.load(bo + 3)
    est_taken = tl.load(bo + 4)
    last = bases_ptr + (row * (NCHUNK + 1) + NCHUNK) * 5
    need1 = tl.load(last + 0)
    need2 = tl.load(last + 1)
    th1, th2 = _thresholds(thr_ptr, row)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = idx < C
    key = radix_keys(tl.load(score_ptr + row * C + idx, mask=valid, other=float("nan")))
    key = tl.where(valid, key, 0)
    eq1 = ((key == th1) & valid).to(tl.int32)
    eq2 = ((key == th2) & valid).to(tl.int32)
    rank1 = _tie_ranks(eq1, eq1_seen)
    rank2 = _tie_ranks(eq2, eq2_seen)
    size = tl.load(sizes_ptr + row * C + idx, mask=valid, other=0)
    real = valid & (size > 0)  # empty clusters rank last and are never read
    sel1 = ((key > th1) | ((eq1 > 0) & (rank1 < need1))) & real
    sel2 = ((key > th2) | ((eq2 > 0) & (rank2 < need2))) & real
    zone = tl.where(sel1, 1, tl.where(sel2, 2, 0)).to(tl.int8)
    tl.store(zone_ptr + row * C + idx, zone, mask=valid)
    first = tl.load(starts_ptr + row * C + idx, mask=sel1, other=0)
    est = sel2 & ~sel1
    # one scan for three running sums: retrieved ids, estimated ids (11 bits each: a chunk
    # holds at most 1024) and retrieved rows (H200, with the tie scans skipped: 18.4 ->
    # 16.3 us at 4 x 1M)
    tl.static_assert(BLOCK <= 1024)
    packed = (sel1.to(tl.int64) | (est.to(tl.int64) << 11)
              | (tl.where(sel1, size, 0).to(tl.int64) << 22))
    before = tl.cumsum(packed, axis=0) - packed
    pos = (before & 2047).to(tl.int32) + taken
    epos = ((before >> 11) & 2047).to(tl.int32) + est_taken
    run = (before >> 22).to(tl.int32) + rows_taken
    tl.store(ids_ptr + row * R_MAX + pos, idx, mask=sel1)
    tl.store(rstart_ptr + row * R_MAX + pos, first, mask=sel1)
    tl.store(cum_ptr + row * (R_MAX + 1) + pos, run, mask=sel1)
    tl.store(est_ptr + row * E_MAX + epos, idx, mask=est & (epos < E_MAX))


_STATS = LazyKernel(_zone_stats_kernel)
_SCAN = LazyKernel(_zone_scan_kernel)
_WRITE = LazyKernel(_zone_write_kernel)


def select_grid(num_clusters: int) -> tuple[int, int]:
    """``(scores per chunk, chunks)`` of a row of ``num_clusters`` clusters in the zone
    kernels."""
    block = min(_SELECT_BLOCK, max(16, triton.next_power_of_2(num_clusters)))
    return block, triton.cdiv(num_clusters, block)


def write_zones(score: torch.Tensor, sizes: torch.Tensor, first_row: torch.Tensor,
                k1: torch.Tensor, k2: torch.Tensor, counts: torch.Tensor, ncand: torch.Tensor,
                first_pass: int, out: Zones) -> None:
    """Find both thresholds of every row (radix passes ``first_pass..``), then write ``out``.

    ``score [rows, C]`` float32 (``-inf`` never taken); ``sizes``, ``first_row [rows, C]``
    int32; ``k1 <= k2 [rows]`` int32; ``counts`` and ``ncand`` the radix histograms and
    candidate counts (:func:`~vecstore.kernels.radix_select.radix_thresholds`), zeroed but
    for the passes before ``first_pass``.
    """
    rows, num_clusters = score.shape
    block, nchunk = select_grid(num_clusters)
    dev = score.device
    stats = torch.empty(rows, nchunk, 12, dtype=torch.int32, device=dev)
    bases = torch.empty(rows, nchunk + 1, 5, dtype=torch.int32, device=dev)
    thr = torch.empty(rows, 2, dtype=torch.int32, device=dev)
    r_max = out.ids.shape[1]
    chain = chained(dev)
    radix_thresholds(score, k1, k2, counts, ncand, thr, first_pass, block, nchunk)
    _STATS[(rows, nchunk)](score, sizes, thr, stats, num_clusters, nchunk, BLOCK=block, **chain)
    _SCAN[(rows,)](score, sizes, k1, k2, thr, stats, bases, out.cum, out.count,
                   out.est_count, num_clusters, nchunk, r_max, BLOCK=block,
                   BLOCK_CH=max(16, triton.next_power_of_2(nchunk)), **chain)
    _WRITE[(rows, nchunk)](score, sizes, first_row, thr, bases, out.zone, out.ids,
                           out.first_row, out.cum, out.est_ids, num_clusters,
                           nchunk, r_max, out.est_ids.shape[1], BLOCK=block, **chain)
