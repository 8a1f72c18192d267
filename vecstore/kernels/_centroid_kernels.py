"""Triton kernels behind :func:`vecstore.kernels.centroid_topk.score_centroids`.

Two launches, each split over clusters so that small batches still fill the GPU:

1. ``_logits_kernel`` — per (sequence, KV head, split): logits of the G query heads of the group
   against the split's centroids (one ``tl.dot`` per tile, so each centroid is read once per
   group), ``-inf`` for empty clusters, plus each head's running max and sum of exponentials
   over the split.
2. ``_group_score_kernel`` — per (sequence, KV head, split): folds the per-split statistics into
   each head's softmax normaliser and writes the ranking score
   ``sum_g softmax(logits_g)_j`` (``-inf`` for empty clusters).

The selection of the top clusters then runs on the ``[B, Hkv, C]`` score.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecstore.kernels._backend import LazyKernel, group_tiles
from vecstore.kernels._device import load_queries, query_group
from vecstore.kernels._rank_device import centroid_logits, group_score, softmax_norm, sum_exp_step
from vecstore.kernels._split import plan_splits

__all__ = ["group_scores_triton"]

# Tuned on the H200 at the Llama-3-8B shape (B 1..32, C 8K..64K): 128-cluster tiles with 4 warps
# and 2 pipeline stages beat 32/64-cluster tiles, 8 warps and 3 stages by 10-25%.
_BLOCK_C = 128
_NUM_WARPS = 4
_NUM_STAGES = 2


def _logits_kernel(
    q_ptr,
    c_ptr,
    n_ptr,
    logits_ptr,
    pmax_ptr,
    psum_ptr,
    C,
    split_len,
    num_splits,
    scale,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    bh, split, offs_d, rows, g_mask = query_group(G, BLOCK_G, BLOCK_D)
    d_mask = offs_d < D
    q = load_queries(q_ptr, rows, offs_d, g_mask[:, None] & d_mask[None, :], D, DOT_F32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK_G], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, C)
    for c0 in range(start, end, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_mask = offs_c < end
        logits = centroid_logits(
            q,
            c_ptr,
            n_ptr,
            bh,
            C,
            offs_c,
            c_mask,
            c_mask[:, None] & d_mask[None, :],
            offs_d,
            scale,
            D,
            PRECISION,
        )  # [BLOCK_G, BLOCK_C]
        tl.store(
            logits_ptr + rows[:, None] * C + offs_c[None, :],
            logits,
            mask=g_mask[:, None] & c_mask[None, :],
        )
        m_i, s_i = sum_exp_step(logits, m_i, s_i)
    tl.store(pmax_ptr + rows * num_splits + split, m_i, mask=g_mask)
    tl.store(psum_ptr + rows * num_splits + split, s_i, mask=g_mask)


def _group_score_kernel(
    logits_ptr,
    pmax_ptr,
    psum_ptr,
    score_ptr,
    C,
    split_len,
    num_splits,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    bh, split, offs_s, rows, g_mask = query_group(G, BLOCK_G, BLOCK_S)
    stat_mask = g_mask[:, None] & (offs_s < num_splits)[None, :]
    stat_offs = rows[:, None] * num_splits + offs_s[None, :]  # [BLOCK_G, BLOCK_S]
    pmax = tl.load(pmax_ptr + stat_offs, mask=stat_mask, other=float("-inf"))
    psum = tl.load(psum_ptr + stat_offs, mask=stat_mask, other=0.0)
    m, inv_z = softmax_norm(pmax, psum)
    start = split * split_len
    end = tl.minimum(start + split_len, C)
    for c0 in range(start, end, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_mask = offs_c < end
        logits = tl.load(
            logits_ptr + rows[:, None] * C + offs_c[None, :],
            mask=g_mask[:, None] & c_mask[None, :],
            other=float("-inf"),
        )  # [BLOCK_G, BLOCK_C]
        score = group_score(logits, m, inv_z)
        tl.store(score_ptr + bh * C + offs_c, score, mask=c_mask)


_LOGITS = LazyKernel(_logits_kernel)
_GROUP_SCORE = LazyKernel(_group_score_kernel)


def group_scores_triton(
    q: torch.Tensor,
    centroids: torch.Tensor,
    sizes: torch.Tensor,
    scale: float,
    logits: torch.Tensor,
) -> torch.Tensor:
    """Write ``logits [B, Hq, C]`` float32 and return the score ``[B, Hkv, C]`` float32.

    Inputs are already checked: ``q`` ``[B, Hq, D]`` and ``centroids`` ``[B, Hkv, C, D]`` share
    a dtype, ``sizes`` is ``[B, Hkv, C]`` integer; all contiguous.
    """
    batch, num_q_heads, dim = q.shape
    num_kv_heads, num_clusters = centroids.shape[1], centroids.shape[2]
    group = num_q_heads // num_kv_heads
    rows = batch * num_kv_heads
    score = torch.empty(batch, num_kv_heads, num_clusters, device=q.device, dtype=torch.float32)
    if num_clusters == 0 or rows == 0:
        return score
    num_splits, split_len = plan_splits(rows, num_clusters, _BLOCK_C, q.device)
    pmax = torch.empty(batch * num_q_heads, num_splits, device=q.device, dtype=torch.float32)
    psum = torch.empty_like(pmax)
    tiles = group_tiles(group, dim, q.dtype)
    grid = (rows, num_splits)
    _LOGITS[grid](
        q,
        centroids,
        sizes,
        logits,
        pmax,
        psum,
        num_clusters,
        split_len,
        num_splits,
        scale,
        BLOCK_C=_BLOCK_C,
        **tiles,
        num_warps=_NUM_WARPS,
        num_stages=_NUM_STAGES,
    )
    _GROUP_SCORE[grid](
        logits,
        pmax,
        psum,
        score,
        num_clusters,
        split_len,
        num_splits,
        G=group,
        BLOCK_G=tiles["BLOCK_G"],
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_C=_BLOCK_C,
    )
    return score
