"""The index probe's selection for rows that fit in one program: score, thresholds and zones
in a single launch.

:mod:`vecstore.kernels.zone_select` finds a row's zones in five launches (the score with the
first radix pass, the other passes, per-chunk counts, a scan per row, the write), each a
round trip through memory on the step's critical path. A row of at most
:data:`ROW_SELECT_MAX` clusters fits in the registers of one program, so
:func:`select_in_rows` runs a program per row that loads the row once -- the GQA-summed
softmax score from the logits, or a given score -- finds the ``k1``-th and ``k2``-th largest
keys by radix passes over its registers (one histogram serves both thresholds while their
prefixes agree), and writes the zones with one scan: the zones of a stable top-k (ties by
cluster id, empty clusters never taken), as the launches they replace write them.

Rows are ``b * Hkv + h``; query rows ``(b * Hkv + h) * G + g``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecstore.errors import InvalidValueError
from vecstore.kernels._rank_device import group_score, softmax_norm
from vecstore.kernels.backend import LazyKernel
from vecstore.kernels.radix_select import (
    RADIX_BITS,
    RADIX_PASSES,
    prefix_digit,
    radix_digit,
    radix_keys,
)
from vecstore.kernels.zones import Zones

__all__ = ["ROW_SELECT_MAX", "select_in_rows"]

# rows of at most this many clusters are selected by one program each (a 128K-token layer in
# clusters of 16 tokens holds 8192 a row); longer rows take the chunked launches
ROW_SELECT_MAX = 8192
_FIELD = 16  # bits per running count in the zone write's packed scan: counts up to 2**16 - 1


@triton.jit
def _kth_keys(key, valid, k1, k2, PASSES: tl.constexpr, BITS: tl.constexpr):
    # the k1-th and k2-th largest keys of the valid ones, MSB first; a pass counts one
    # histogram for both while their prefixes agree (always in pass 0)
    t1 = tl.zeros([1], tl.uint32)
    t2 = tl.zeros([1], tl.uint32)
    above1 = tl.zeros([1], tl.int32)
    above2 = tl.zeros([1], tl.int32)
    for p in tl.static_range(PASSES):
        p1 = tl.sum(t1, axis=0)
        p2 = tl.sum(t2, axis=0)
        digit, match1 = prefix_digit(key, valid, p1, p, BITS)
        h1 = tl.histogram(digit, 1 << BITS, mask=match1)
        if p == 0:
            h2 = h1
        else:
            if (p1 >> (32 - BITS * p)) == (p2 >> (32 - BITS * p)):
                h2 = h1
            else:
                h2 = tl.histogram(digit, 1 << BITS, mask=prefix_digit(key, valid, p2, p, BITS)[1])
        d1, above1 = radix_digit(h1[None, :], above1, k1, p, BITS)
        d2, above2 = radix_digit(h2[None, :], above2, k2, p, BITS)
        t1 = t1 | d1
        t2 = t2 | d2
    return tl.sum(t1, axis=0), tl.sum(t2, axis=0)


@triton.jit
def _taken(key, valid, real, th, k):
    # of the k best keys (ties in id order, empty clusters ranked but never taken), which the
    # row takes: every key above th, and the first ties at th that fit
    gt = (key > th) & valid
    eq = ((key == th) & valid).to(tl.int32)
    need = k - tl.sum(gt.to(tl.int32), axis=0)
    rank = tl.cumsum(eq, axis=0) - eq
    return (gt | ((eq > 0) & (rank < need))) & real


def _row_select_kernel(
    rank_ptr, pmax_ptr, psum_ptr, score_ptr, sizes_ptr, starts_ptr, k1_ptr, k2_ptr,
    zone_ptr, ids_ptr, rstart_ptr, cum_ptr, count_ptr, est_ptr, est_count_ptr,
    C, num_splits, R_MAX, E_MAX,
    RANKED: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    PASSES: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr, FIELD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK)
    valid = idx < C
    if RANKED:
        # the score sum_g softmax_g(ranking logits)_j, each head normalised by its splits'
        # maxima and sums of exponentials
        offs_g = tl.arange(0, BLOCK_G)
        offs_s = tl.arange(0, BLOCK_S)
        qrows = row * G + offs_g
        sm = (offs_g < G)[:, None] & (offs_s < num_splits)[None, :]
        pm = tl.load(pmax_ptr + qrows[:, None] * num_splits + offs_s[None, :], mask=sm,
                     other=float("-inf"))
        ps = tl.load(psum_ptr + qrows[:, None] * num_splits + offs_s[None, :], mask=sm,
                     other=0.0)
        m, inv_z = softmax_norm(pm, ps)
        score = group_score(rank_ptr, row * G, C, idx, valid, m, inv_z, offs_g, G)
    else:
        score = tl.load(score_ptr + row * C + idx, mask=valid, other=0.0)
    key = tl.where(valid, radix_keys(score), 0)
    k1 = tl.load(k1_ptr + row)
    k2 = tl.load(k2_ptr + row)
    th1, th2 = _kth_keys(key, valid, k1, k2, PASSES, BITS)
    size = tl.load(sizes_ptr + row * C + idx, mask=valid, other=0)
    real = valid & (size > 0)
    sel1 = _taken(key, valid, real, th1, k1)
    est = _taken(key, valid, real, th2, k2) & ~sel1
    tl.store(zone_ptr + row * C + idx, tl.where(sel1, 1, tl.where(est, 2, 0)).to(tl.int8),
             mask=valid)
    # one scan for three running sums: retrieved ids, estimated ids and retrieved rows
    tl.static_assert(BLOCK < (1 << FIELD))
    rows_taken = tl.where(sel1, size, 0).to(tl.int64)
    packed = sel1.to(tl.int64) | (est.to(tl.int64) << FIELD) | (rows_taken << (2 * FIELD))
    before = tl.cumsum(packed, axis=0) - packed
    pos = (before & ((1 << FIELD) - 1)).to(tl.int32)
    epos = ((before >> FIELD) & ((1 << FIELD) - 1)).to(tl.int32)
    run = (before >> (2 * FIELD)).to(tl.int32)
    first = tl.load(starts_ptr + row * C + idx, mask=sel1, other=0)
    tl.store(ids_ptr + row * R_MAX + pos, idx, mask=sel1)
    tl.store(rstart_ptr + row * R_MAX + pos, first, mask=sel1)
    tl.store(cum_ptr + row * (R_MAX + 1) + pos, run, mask=sel1)
    tl.store(est_ptr + row * E_MAX + epos, idx, mask=est & (epos < E_MAX))
    total = tl.sum(sel1.to(tl.int32), axis=0)
    tl.store(count_ptr + row, total)
    tl.store(est_count_ptr + row, tl.sum(est.to(tl.int32), axis=0))
    tl.store(cum_ptr + row * (R_MAX + 1) + total, tl.sum(rows_taken, axis=0).to(tl.int32))


_ROW_SELECT = LazyKernel(_row_select_kernel)


def select_in_rows(sizes: torch.Tensor, first_row: torch.Tensor, k1: torch.Tensor,
                   k2: torch.Tensor, out: Zones, *, score: torch.Tensor | None = None,
                   rank: torch.Tensor | None = None, pmax: torch.Tensor | None = None,
                   psum: torch.Tensor | None = None) -> None:
    """Write the zones of rows of at most :data:`ROW_SELECT_MAX` clusters, a program per row:
    ranked by ``score [rows, C]`` float32, or by the GQA-summed softmax of the ranking logits
    ``rank [rows * G, C]`` with their splits' ``pmax``/``psum [rows * G, splits]`` (as
    :func:`~vecstore.kernels.centroid_logits.centroid_logits` leaves them). ``sizes``,
    ``first_row [rows, C]`` int32; ``k1 <= k2 [rows]`` int32. ``out`` as
    :func:`~vecstore.kernels.zone_select.select_zones` writes it."""
    rows, num_clusters = sizes.shape
    if num_clusters > ROW_SELECT_MAX:
        raise InvalidValueError(f"rows of {num_clusters} clusters: at most {ROW_SELECT_MAX} "
                         "are selected a program per row")
    ranked = score is None
    group = rank.shape[0] // rows if ranked else 1
    splits = pmax.shape[1] if ranked else 1
    block = max(16, triton.next_power_of_2(num_clusters))
    anything = sizes  # a pointer the kernel does not read on its path
    _ROW_SELECT[(rows,)](
        rank if ranked else anything, pmax if ranked else anything,
        psum if ranked else anything, anything if ranked else score, sizes, first_row, k1, k2,
        out.zone, out.ids, out.first_row, out.cum, out.count, out.est_ids, out.est_count,
        num_clusters, splits, out.ids.shape[1], out.est_ids.shape[1],
        RANKED=ranked, G=group, BLOCK_G=triton.next_power_of_2(group),
        BLOCK_S=triton.next_power_of_2(splits), PASSES=RADIX_PASSES, BITS=RADIX_BITS,
        BLOCK=block, FIELD=_FIELD, num_warps=max(4, min(16, block // 512)))
