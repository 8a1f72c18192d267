"""Triton split-K decode attention behind :mod:`vecstore.kernels.sparse_attention`.

One kernel, ``_ranges_attention_kernel``, attends the G query heads of a group to row ranges of
their KV head's ``[N, D]`` keys and values (flash-decoding: online softmax per program, then
:func:`vecstore.kernels._split.combine_splits`). Each K/V row is read once per group. Two modes:

- buffer (``BY_CLUSTERS=False``): the range is ``[0, lengths[b, h])`` of a gathered buffer, and
  the splits cut it into equal pieces;
- clusters (``BY_CLUSTERS=True``): the ranges are ``[starts[r], starts[r] + lengths[r])`` of a
  cluster-contiguous store, read in place, and the splits cut the list of ranges.
"""

from __future__ import annotations

import torch
import triton.language as tl

from vecstore.kernels._backend import LazyKernel, group_tiles
from vecstore.kernels._device import (
    add_values,
    empty_state,
    load_queries,
    query_group,
    store_state,
)
from vecstore.kernels._split import combine_splits, plan_splits, split_states

__all__ = ["buffer_attention_triton", "cluster_attention_triton"]

_BLOCK_N_BUFFER = 64
_BLOCK_N_CLUSTERS = 16


def _ranges_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    starts_ptr,
    lengths_ptr,
    part_out_ptr,
    part_lse_ptr,
    N,
    R,
    split_len,
    num_splits,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BY_CLUSTERS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    bh, split, offs_d, rows, g_mask = query_group(G, BLOCK_G, BLOCK_D)
    d_mask = offs_d < D
    qd_mask = g_mask[:, None] & d_mask[None, :]
    q = load_queries(q_ptr, rows, offs_d, qd_mask, D, DOT_F32)
    m_i, l_i, acc = empty_state(BLOCK_G, BLOCK_D)
    if BY_CLUSTERS:
        r_lo = split * split_len
        r_hi = tl.minimum(r_lo + split_len, R)
    else:
        r_lo = 0
        r_hi = 1
    for r in range(r_lo, r_hi):
        if BY_CLUSTERS:
            start = tl.load(starts_ptr + bh * R + r).to(tl.int64)
            count = tl.load(lengths_ptr + bh * R + r).to(tl.int64)
            lo = tl.maximum(start, 0)
            hi = tl.minimum(start + count, N)
        else:
            length = tl.minimum(tl.maximum(tl.load(lengths_ptr + bh).to(tl.int64), 0), N)
            lo = split * split_len
            hi = tl.minimum(lo + split_len, length)
        # Every tile below holds at least one valid row, so the running max stays finite.
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < hi
            kv_offs = (bh * N + offs_n)[:, None] * D + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
            kv_mask = n_mask[:, None] & d_mask[None, :]
            keys = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
            if DOT_F32:
                keys = keys.to(tl.float32)
            s = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_N]
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            values = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
            acc = add_values(acc, alpha, p, values, PRECISION, DOT_F32)
            m_i = m_new
    store_state(
        part_out_ptr,
        part_lse_ptr,
        rows,
        g_mask,
        qd_mask,
        offs_d,
        split,
        num_splits,
        m_i,
        l_i,
        acc,
        D,
    )


_RANGES_ATTENTION = LazyKernel(_ranges_attention_kernel)


def _launch(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor | None,
    lengths: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    split_items: int,
    block_n: int,
) -> None:
    """Run the kernel over splits of ``split_items`` items and combine; see the launchers."""
    batch, num_q_heads, dim = q.shape
    num_kv_heads, num_rows = keys.shape[1], keys.shape[2]
    group = num_q_heads // num_kv_heads
    rows = batch * num_kv_heads
    if rows == 0 or num_q_heads == 0:
        return
    by_clusters = starts is not None
    num_splits, split_len = plan_splits(rows, split_items, 1 if by_clusters else block_n, q.device)
    part_out, part_lse = split_states(out, lse, num_splits)
    _RANGES_ATTENTION[(rows, num_splits)](
        q,
        keys,
        values,
        lengths if starts is None else starts,
        lengths,
        part_out,
        part_lse,
        num_rows,
        1 if starts is None else starts.shape[2],
        split_len,
        num_splits,
        scale,
        BY_CLUSTERS=by_clusters,
        BLOCK_N=block_n,
        **group_tiles(group, dim, keys.dtype),
    )
    combine_splits(part_out, part_lse, out, lse)


def buffer_attention_triton(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Attention over the first ``lengths[b, h]`` rows of ``[B, Hkv, M, D]`` buffers.

    Inputs are already checked and contiguous; writes float32 ``out [B, Hq, D]`` and
    ``lse [B, Hq]``.
    """
    _launch(q, k_buf, v_buf, None, lengths, scale, out, lse, k_buf.shape[2], _BLOCK_N_BUFFER)


def cluster_attention_triton(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Attention over row ranges ``[starts, starts + lengths)`` of ``[B, Hkv, N, D]`` stores.

    Inputs are already checked and contiguous; ``starts`` and ``lengths`` are ``[B, Hkv, R]``.
    Writes float32 ``out [B, Hq, D]`` and ``lse [B, Hq]``.
    """
    _launch(q, keys, values, starts, lengths, scale, out, lse, starts.shape[2], _BLOCK_N_CLUSTERS)
