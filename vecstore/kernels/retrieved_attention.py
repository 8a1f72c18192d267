"""Split-K attention over the retrieved zone: every row of the retrieved clusters, exactly.

The rows are read in place from the KV rows through a row map (:func:`fill_rowmap` writes it
from the zones of :func:`vecstore.kernels.zone_select.select_ranked`), or from a contiguous
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

__all__ = ["RETRIEVED_SPLIT", "retrieved_layout", "fill_rowmap", "attend_retrieved"]

# rows (clusters) per split; larger splits measured 11 us faster than 256 / 128 at 8 x 128K on
# the H200 (fewer partial states to write and merge), the same at 4 x 1M. The splits a zone
# of at most max_rows rows gets; each row's rows spread evenly over them (H200, whole steps
# against 512 rows a split: 8 x 128K 0.142 against 0.145 ms, 8 x 512K 0.375 / 0.376, 4 x 1M
# 0.369 / 0.370, 8 x 1M 0.679 / 0.677; 256-row splits no faster)
RETRIEVED_SPLIT = 512
_BLOCK_N = 64
_ROWMAP_CLUSTERS = 32  # retrieved clusters per program of the row-map kernel


def _retrieved_kernel(
    q_ptr, k_ptr, v_ptr, map_ptr, cum_ptr, count_ptr, span_ptr,
    part_out_ptr, part_lse_ptr,
    N, M, R_MAX, scale, softcap, split_base, num_parts,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    CONTIG: tl.constexpr, SPAN: tl.constexpr, DOT_F32: tl.constexpr, SOFTCAP: tl.constexpr,
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
        m_i, l_i, acc = attend_rows(q, k_ptr, v_ptr, kv_off, pmask, scale, softcap, m_i, l_i,
                                    acc, DOT_F32, SOFTCAP)
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


_RETRIEVED = LazyKernel(_retrieved_kernel)
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
                     split: torch.Tensor | None = None, after_split: bool = False,
                     softcap: float | None = None) -> None:
    """Partial states of the retrieved rows.

    ``keys``/``values`` are ``[rows, N, D]`` (each row's ``[N, D]`` contiguous; rows may sit
    further apart, :func:`~vecstore.kernels.backend.row_stride`): with ``rowmap [rows, M]`` (from
    :func:`fill_rowmap`) the KV rows themselves, read in place; without it an execution
    buffer holding a row's ``cum[count]`` retrieved rows contiguously. With ``split [rows]``
    int32 only positions ``0:split`` of each row (or ``split:cum[count]`` if
    ``after_split``), spread evenly over the splits. ``q`` is ``[rows * G, D]``;
    ``parts`` the ``[rows * G, P, D]`` and ``[rows * G, P]`` float32 partial outputs and
    log-sum-exps, of which this writes ``retrieved_layout(M)[1]`` from ``split_base`` on.
    ``softcap`` soft-caps the scores (``None``: no cap).
    """
    rows, n_rows, dim = keys.shape
    group = q.shape[0] // rows
    m = rowmap.shape[1] if rowmap is not None else n_rows
    _, num_splits = retrieved_layout(m)
    _RETRIEVED[(rows, num_splits)](
        q, keys, values, rowmap if rowmap is not None else zones.cum, zones.cum, zones.count,
        split if split is not None else zones.count, parts[0], parts[1],
        row_stride(keys, values), m,
        zones.ids.shape[1], scale, softcap or 1.0, split_base, parts[1].shape[1],
        G=group, D=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=_BLOCK_N,
        CONTIG=rowmap is None, SPAN=0 if split is None else 2 if after_split else 1,
        DOT_F32=needs_f32_dot(keys.dtype), SOFTCAP=softcap is not None,
    )
