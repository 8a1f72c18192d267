"""Triton kernels of the wave executor's attention: the three zones, merged.

``attend_retrieved`` / ``attend_steady`` / ``attend_estimated`` — split-K flash decoding over
the retrieved rows (in place through the row map ``fill_rowmap`` writes from the zones of
:func:`vecstore.executor.wave_select.select_ranked`, or from a contiguous execution
buffer), over the steady zone, and over the compacted estimated clusters (centroid logits
plus log size, value means). Each split writes a partial ``(out, lse)``; ``combine`` merges
every split of a query row by log-sum-exp.

Rows are ``b * Hkv + h``; query rows ``(b * Hkv + h) * G + g`` (``[B, Hq]`` flattened).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from vecstore.kernels._backend import LazyKernel, needs_f32_dot
from vecstore.kernels._device import (
    empty_state,
    load_queries,
    query_group,
    store_merged,
    store_state,
)

if TYPE_CHECKING:
    from vecstore.executor.wave_state import Zones

__all__ = [
    "retrieved_layout",
    "fill_rowmap",
    "steady_splits",
    "estimate_layout",
    "attend_retrieved",
    "attend_steady",
    "attend_estimated",
    "combine",
    "RETRIEVED_SPLIT",
    "STEADY_SPLIT",
    "ESTIMATE_SPLIT",
]

# rows (clusters) per split; larger splits measured 11 us faster than 256 / 128 at 8 x 128K on
# the H200 (fewer partial states to write and merge), the same at 4 x 1M. The splits a zone
# of at most max_rows rows gets; each row's rows spread evenly over them (H200, whole steps
# against 512 rows a split: 8 x 128K 0.142 against 0.145 ms, 8 x 512K 0.375 / 0.376, 4 x 1M
# 0.369 / 0.370, 8 x 1M 0.679 / 0.677; 256-row splits no faster)
RETRIEVED_SPLIT = 512
STEADY_SPLIT = 256
ESTIMATE_SPLIT = 256
_BLOCK_N = 64
_BLOCK_E = 128
# splits per row the estimation zone aims at (each >= ESTIMATE_SPLIT), and its warps; H200
# whole steps at 8 x 128K / 8 x 512K / 4 x 1M / 8 x 1M, against 32 splits of 64-cluster
# tiles: 0.150 / 0.423 / 0.421 / 0.768 ms against 0.151 / 0.434 / 0.427 / 0.786 (16 splits
# of 64: 0.151 / 0.426 / 0.421 / 0.777; 32 of 128: 0.151 / 0.433 / 0.424 / 0.773). Earlier,
# with 64-cluster tiles: 64 or 128 splits and 8 warps slower, retrieved splits of 256 or 1024
# rows no faster. With int8 centroid codes and two pipelined row groups, 12 splits: 0.376 /
# 0.370 / 0.679 ms at 8 x 512K / 4 x 1M / 8 x 1M against 0.381 / 0.371 / 0.694 with 16 (8:
# 0.373 / 0.379 / 0.677)
_ESTIMATE_SPLITS = 12
_ESTIMATE_WARPS = 4
# pipeline stages of the estimation's loop: 0.424 ms at 4 x 1M against 0.444 with 2 and 0.424
# with 4; 0.779 against 0.813 / 0.780 at 8 x 1M
_ESTIMATE_STAGES = 3
_ROWMAP_CLUSTERS = 32  # retrieved clusters per program of the row-map kernel
# the merge: partial outputs per step of its loop, head dims per program. 64 against 16, H200
# whole steps: 4 x 1M 0.369 against 0.372 ms, 8 x 128K and 1 x 1M the same; offloaded (twice
# the retrieved splits) 1 x 1M 0.373 against 0.401-0.407, 4 x 1M 1.264 against 1.286-1.288
_COMBINE_BLOCK = 64
_COMBINE_DIMS = 128


@triton.jit
def _softmax_step(s, v, m_i, l_i, acc):
    # fold scores s [G, N] (-inf where masked) and values v [N, D] into the running max,
    # sum of exp and weighted sum of one query row group
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    pr = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attend_rows(q, k_ptr, v_ptr, kv_off, pmask, scale, m_i, l_i, acc,
                 DOT_F32: tl.constexpr):
    # one tile of exact attention: rows kv_off [N, D] of K and V, valid where pmask
    k = tl.load(k_ptr + kv_off, mask=pmask[:, None], other=0.0)
    v = tl.load(v_ptr + kv_off, mask=pmask[:, None], other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(pmask[None, :], s, float("-inf"))
    return _softmax_step(s, v, m_i, l_i, acc)


def _retrieved_kernel(
    q_ptr, k_ptr, v_ptr, map_ptr, cum_ptr, count_ptr, span_ptr,
    part_out_ptr, part_lse_ptr,
    N, M, R_MAX, scale, split_base, num_parts,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    CONTIG: tl.constexpr, SPAN: tl.constexpr, DOT_F32: tl.constexpr,
):
    # split `split` of the row's retrieved rows, read from a contiguous execution buffer
    # (CONTIG) or, in place, through the row map. SPAN 0: all of them; 1: positions
    # [0, span), 2: [span, total); spread evenly over the row's splits
    row, split, offs_d, qrows, g_mask = query_group(G, BLOCK_G, D)
    q = load_queries(q_ptr, qrows, offs_d, g_mask[:, None], D, DOT_F32)
    stop = tl.load(cum_ptr + row * (R_MAX + 1) + tl.load(count_ptr + row))
    start = 0
    if SPAN == 1:
        stop = tl.load(span_ptr + row)
    elif SPAN == 2:
        start = tl.load(span_ptr + row)
    per = tl.cdiv(tl.cdiv(stop - start, tl.num_programs(1)), BLOCK_N) * BLOCK_N
    p0 = start + split * per
    p1 = tl.minimum(p0 + per, stop)
    m_i, l_i, acc = empty_state(BLOCK_G, D)
    for p in range(p0, p1, BLOCK_N):
        pos = p + tl.arange(0, BLOCK_N)
        pmask = pos < p1
        if CONTIG:
            src = pos.to(tl.int64)
        else:
            src = tl.load(map_ptr + row * M + pos, mask=pmask, other=0).to(tl.int64)
        kv_off = (row * N + src)[:, None] * D + offs_d[None, :]
        m_i, l_i, acc = _attend_rows(q, k_ptr, v_ptr, kv_off, pmask, scale, m_i, l_i, acc,
                                     DOT_F32)
    store_state(part_out_ptr, part_lse_ptr, qrows, g_mask, g_mask[:, None], offs_d,
                split_base + split, num_parts, m_i, l_i, acc, D)


def _steady_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, part_out_ptr, part_lse_ptr,
    H, S, scale, split_base, num_parts, split_len,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    row, split, offs_d, qrows, g_mask = query_group(G, BLOCK_G, D)
    q = load_queries(q_ptr, qrows, offs_d, g_mask[:, None], D, DOT_F32)
    length = tl.load(len_ptr + row // H).to(tl.int32)
    p0 = split * split_len
    p1 = tl.minimum(p0 + split_len, length)
    m_i, l_i, acc = empty_state(BLOCK_G, D)
    for p in range(p0, p1, BLOCK_N):
        pos = p + tl.arange(0, BLOCK_N)
        pmask = pos < p1
        kv_off = (row * S + pos)[:, None] * D + offs_d[None, :]
        m_i, l_i, acc = _attend_rows(q, k_ptr, v_ptr, kv_off, pmask, scale, m_i, l_i, acc,
                                     DOT_F32)
    store_state(part_out_ptr, part_lse_ptr, qrows, g_mask, g_mask[:, None], offs_d,
                split_base + split, num_parts, m_i, l_i, acc, D)


def _estimated_kernel(
    weight_ptr, vmean_ptr, est_ptr, est_count_ptr, part_out_ptr, part_lse_ptr,
    C, E_MAX, split_base, num_parts, split_len,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # positions [split * split_len, ...) of the row's compacted estimated clusters
    row, split, offs_d, qrows, g_mask = query_group(G, BLOCK_G, D)
    e0 = split * split_len
    e1 = tl.minimum(e0 + split_len, tl.load(est_count_ptr + row))
    m_i, l_i, acc = empty_state(BLOCK_G, D)
    for e in range(e0, e1, BLOCK_E):
        pos = e + tl.arange(0, BLOCK_E)
        use = pos < e1
        idx = tl.load(est_ptr + row * E_MAX + pos, mask=use, other=0).to(tl.int64)
        w = tl.load(weight_ptr + qrows[:, None] * C + idx[None, :],
                    mask=g_mask[:, None] & use[None, :], other=float("-inf"))
        vm = tl.load(vmean_ptr + (row * C + idx)[:, None] * D + offs_d[None, :],
                     mask=use[:, None], other=0.0)
        if DOT_F32:
            vm = vm.to(tl.float32)
        m_i, l_i, acc = _softmax_step(w, vm, m_i, l_i, acc)
    store_state(part_out_ptr, part_lse_ptr, qrows, g_mask, g_mask[:, None], offs_d,
                split_base + split, num_parts, m_i, l_i, acc, D)


def _rowmap_kernel(cum_ptr, count_ptr, rstart_ptr, rowmap_ptr, R_MAX, M,
                   BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr):
    # execution position -> KV row for BLOCK_I retrieved clusters of a row at once, a
    # [BLOCK_I, BLOCK_N] tile of their rows per step (a program per cluster left most of
    # the grid idle: clusters hold ~16 rows); fusing this into the zone write as a loop over
    # cluster rows measured 150x slower on the H200
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    use = i < tl.load(count_ptr + row)
    p0 = tl.load(cum_ptr + row * (R_MAX + 1) + i, mask=use, other=0)
    n = tl.load(cum_ptr + row * (R_MAX + 1) + i + 1, mask=use, other=0) - p0
    first = tl.load(rstart_ptr + row * R_MAX + i, mask=use, other=0)
    for j in range(0, tl.max(n, axis=0), BLOCK_N):
        offs = j + tl.arange(0, BLOCK_N)
        tl.store(rowmap_ptr + row * M + p0[:, None] + offs[None, :],
                 first[:, None] + offs[None, :], mask=offs[None, :] < n[:, None])


def _combine_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, P,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                    BLOCK_P: tl.constexpr):
    # head dims [d0, d0 + BLOCK_D) of a query row: the largest log-sum-exp BLOCK_L parts at a
    # time (one load for P up to BLOCK_L), then the partial outputs merged BLOCK_P at a time
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_l = tl.arange(0, BLOCK_L)
    m = tl.full([BLOCK_L], float("-inf"), tl.float32)
    for p0 in range(0, P, BLOCK_L):
        lp = tl.load(part_lse_ptr + row * P + p0 + offs_l, mask=p0 + offs_l < P,
                     other=float("-inf"))
        m = tl.maximum(m, lp)
    mx = tl.max(m, axis=0)
    m_safe = tl.where(mx == float("-inf"), 0.0, mx)
    offs_p = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_P], tl.float32)
    for p0 in range(0, P, BLOCK_P):
        pm = p0 + offs_p < P
        w = tl.exp(tl.load(part_lse_ptr + row * P + p0 + offs_p, mask=pm, other=float("-inf"))
                   - m_safe)
        o = tl.load(part_out_ptr + (row * P + p0 + offs_p)[:, None] * D + offs_d[None, :],
                    mask=pm[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
        den += w
    # every head-dim block of the row stores the same lse
    store_merged(out_ptr, lse_ptr, row, offs_d, None, acc, tl.sum(den, axis=0), m_safe, D)


_RETRIEVED = LazyKernel(_retrieved_kernel)
_STEADY = LazyKernel(_steady_kernel)
_ESTIMATED = LazyKernel(_estimated_kernel)
_COMBINE = LazyKernel(_combine_kernel)
_ROWMAP = LazyKernel(_rowmap_kernel)


def retrieved_layout(max_rows: int) -> tuple[int, int]:
    """``(nominal positions per split, splits)`` of a retrieved zone of at most ``max_rows``
    rows (the kernel spreads each row's rows evenly over the splits)."""
    per = RETRIEVED_SPLIT
    while triton.cdiv(max_rows, per) > 64:
        per *= 2
    return per, max(1, triton.cdiv(max_rows, per))


def fill_rowmap(zones: Zones, rowmap: torch.Tensor) -> None:
    """Write the KV row behind each retrieved position: ``rowmap [rows, M]`` int32, position
    ``cum[i] + j`` of a row holding ``first_row[i] + j`` (positions past ``cum[count]`` are
    left as they were), so the retrieved rows are read in place."""
    rows, r_max = zones.ids.shape
    _ROWMAP[(rows, triton.cdiv(r_max, _ROWMAP_CLUSTERS))](
        zones.cum, zones.count, zones.first_row, rowmap, r_max, rowmap.shape[1],
        BLOCK_I=_ROWMAP_CLUSTERS, BLOCK_N=16)


def attend_retrieved(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, zones: Zones,
                     rowmap: torch.Tensor | None, scale: float,
                     parts: tuple[torch.Tensor, torch.Tensor], split_base: int, *,
                     split: torch.Tensor | None = None, after_split: bool = False) -> None:
    """Partial states of the retrieved rows.

    ``keys``/``values`` are ``[rows, N, D]``: with ``rowmap [rows, M]`` (from
    :func:`fill_rowmap`) the KV rows themselves, read in place; without it an execution
    buffer holding a row's ``cum[count]`` retrieved rows contiguously. With ``split [rows]``
    int32 only positions ``0:split`` of each row (or ``split:cum[count]`` if
    ``after_split``), spread evenly over the splits. ``q`` is ``[rows * G, D]``;
    ``parts`` the ``[rows * G, P, D]`` and ``[rows * G, P]`` float32 partial outputs and
    log-sum-exps, of which this writes ``retrieved_layout(M)[1]`` from ``split_base`` on.
    """
    rows, n_rows, dim = keys.shape
    group = q.shape[0] // rows
    m = rowmap.shape[1] if rowmap is not None else n_rows
    _, num_splits = retrieved_layout(m)
    _RETRIEVED[(rows, num_splits)](
        q, keys, values, rowmap if rowmap is not None else zones.cum, zones.cum, zones.count,
        split if split is not None else zones.count, parts[0], parts[1], n_rows, m,
        zones.ids.shape[1], scale, split_base, parts[1].shape[1],
        G=group, D=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=_BLOCK_N,
        CONTIG=rowmap is None, SPAN=0 if split is None else 2 if after_split else 1,
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


def estimate_layout(e_max: int) -> tuple[int, int]:
    """``(positions per split, splits)`` of an estimation zone of at most ``e_max`` clusters."""
    per = max(ESTIMATE_SPLIT,
              triton.cdiv(triton.cdiv(e_max, _ESTIMATE_SPLITS), _BLOCK_E) * _BLOCK_E)
    return per, max(1, triton.cdiv(e_max, per))


def attend_estimated(weights: torch.Tensor, vmean: torch.Tensor, zones: Zones,
                     parts: tuple[torch.Tensor, torch.Tensor], split_base: int) -> None:
    """Partial states of the estimated clusters (``zones.est_ids``): log weights
    ``logit + log size`` ``[rows * G, C]`` float32 (as
    :func:`~vecstore.executor.wave_select.centroid_logits` writes them), value means
    ``vmean [rows, C, D]``."""
    rows, num_clusters, dim = vmean.shape
    group = weights.shape[0] // rows
    e_max = zones.est_ids.shape[1]
    per, num_splits = estimate_layout(e_max)
    _ESTIMATED[(rows, num_splits)](
        weights, vmean, zones.est_ids, zones.est_count, parts[0], parts[1],
        num_clusters, e_max, split_base, parts[1].shape[1], per,
        G=group, D=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_E=_BLOCK_E,
        DOT_F32=needs_f32_dot(vmean.dtype), num_warps=_ESTIMATE_WARPS,
        num_stages=_ESTIMATE_STAGES,
    )


def combine(parts: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor,
            lse: torch.Tensor) -> None:
    """Merge every partial state of a query row: ``out [rows * G, D]`` (any float dtype) and
    ``lse [rows * G]`` float32, written in place."""
    qrows, num_parts, dim = parts[0].shape
    block_d = min(dim, _COMBINE_DIMS)
    _COMBINE[(qrows, dim // block_d)](
        parts[0], parts[1], out, lse, num_parts, D=dim, BLOCK_D=block_d,
        BLOCK_L=min(256, max(16, triton.next_power_of_2(num_parts))), BLOCK_P=_COMBINE_BLOCK)
