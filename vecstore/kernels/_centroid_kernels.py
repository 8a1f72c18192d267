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

from vecstore.kernels._backend import LazyKernel, dot_precision, needs_f32_dot
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
    bh = tl.program_id(0).to(tl.int64)  # b * Hkv + kv head; int64 offsets: large stores
    split = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < G
    d_mask = offs_d < D
    rows = bh * G + offs_g  # query rows of this group in [B * Hq]
    q = tl.load(
        q_ptr + rows[:, None] * D + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if DOT_F32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK_G], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, C)
    for c0 in range(start, end, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_mask = offs_c < end
        cent = tl.load(
            c_ptr + (bh * C + offs_c)[:, None] * D + offs_d[None, :],
            mask=c_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_C, BLOCK_D]
        if DOT_F32:
            cent = cent.to(tl.float32)
        sizes = tl.load(n_ptr + bh * C + offs_c, mask=c_mask, other=0)
        logits = tl.dot(q, tl.trans(cent), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_C]
        logits = tl.where((sizes > 0)[None, :], logits, float("-inf"))
        tl.store(
            logits_ptr + rows[:, None] * C + offs_c[None, :],
            logits,
            mask=g_mask[:, None] & c_mask[None, :],
        )
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_i = s_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(logits - m_safe[:, None]), axis=1)
        m_i = m_new
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
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    g_mask = offs_g < G
    rows = bh * G + offs_g
    stat_mask = g_mask[:, None] & (offs_s < num_splits)[None, :]
    stat_offs = rows[:, None] * num_splits + offs_s[None, :]  # [BLOCK_G, BLOCK_S]
    pmax = tl.load(pmax_ptr + stat_offs, mask=stat_mask, other=float("-inf"))
    psum = tl.load(psum_ptr + stat_offs, mask=stat_mask, other=0.0)
    m = tl.max(pmax, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    z = tl.sum(psum * tl.exp(pmax - m[:, None]), axis=1)  # softmax denominator per head
    inv_z = 1.0 / tl.where(z > 0, z, 1.0)
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
        probs = tl.exp(logits - m[:, None]) * inv_z[:, None]
        score = tl.sum(probs, axis=0)
        is_valid = tl.max(logits, axis=0) > float("-inf")
        tl.store(score_ptr + bh * C + offs_c, tl.where(is_valid, score, float("-inf")), mask=c_mask)


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
    block_g = max(16, triton.next_power_of_2(group))
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
        G=group,
        D=dim,
        BLOCK_G=block_g,
        BLOCK_C=_BLOCK_C,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        PRECISION=dot_precision(q.dtype),
        DOT_F32=needs_f32_dot(q.dtype),
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
        BLOCK_G=block_g,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_C=_BLOCK_C,
    )
    return score
