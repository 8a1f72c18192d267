"""Triton device functions that rank clusters, shared by the index probe's two kernels.

:mod:`vecstore.kernels.centroid_logits` and :mod:`vecstore.kernels.zone_select` score the
clusters of a KV head for the ``G`` query heads of its group in two launches: the first
computes centroid logits a tile at a time and each head's running max and sum of exponentials
over its split of the clusters; the second folds those per-split statistics into each head's
softmax normaliser and writes the score ``sum_g softmax(logits_g)_j``.

Plain ``@triton.jit`` functions: Triton inlines them into the kernels that call them.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["tile_logits", "sum_exp_step", "softmax_norm", "group_score"]


@triton.jit
def tile_logits(
    q,
    c_ptr,
    n_ptr,
    row,
    C,
    offs_c,
    c_mask,
    cent_mask,
    offs_d,
    scale,
    D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # logits [G, BLOCK_C] of the queries q against centroids offs_c of the row, read in any
    # dtype and multiplied in q's (float32 for float32 dots, int8 codes exactly in bfloat16);
    # -inf for empty clusters (size <= 0)
    cent = tl.load(
        c_ptr + (row * C + offs_c)[:, None] * D + offs_d[None, :], mask=cent_mask, other=0.0
    )  # [BLOCK_C, BLOCK_D]
    if cent.dtype != q.dtype:
        cent = cent.to(q.dtype)
    sizes = tl.load(n_ptr + row * C + offs_c, mask=c_mask, other=0)
    logits = tl.dot(q, tl.trans(cent), input_precision=PRECISION) * scale
    return tl.where((sizes > 0)[None, :], logits, float("-inf"))


@triton.jit
def sum_exp_step(x, m_i, s_i):
    # fold a tile x [G, N] (-inf where masked) into each head's running max and sum of exp
    m_new = tl.maximum(m_i, tl.max(x, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    s_i = s_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
    return m_new, s_i


@triton.jit
def softmax_norm(pmax, psum):
    # each head's max m and inverse softmax denominator 1 / z, from its per-split maxima
    # pmax [G, S] (-inf where masked) and sums of exp psum [G, S] (0 where masked)
    m = tl.max(pmax, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    z = tl.sum(psum * tl.exp(pmax - m[:, None]), axis=1)
    return m, 1.0 / tl.where(z > 0, z, 1.0)


@triton.jit
def group_score(rank_ptr, qrow0, C, idx, valid, m, inv_z, offs_g, G: tl.constexpr):
    # sum over the group's G heads of softmax(logits)_j for clusters idx (-inf where every
    # head's logit is -inf), from each head's max m [BLOCK_G] and 1 / z; the heads' logits
    # rows start at query row qrow0. Head by head in one order, so a cluster's score is a
    # function of its logits only: a [G, N] reduction rounds by where a column sits, which
    # split exact ties by an ulp and broke the by-id order of tied clusters (seen on the H200)
    score = tl.zeros(idx.shape, tl.float32)
    best = tl.full(idx.shape, float("-inf"), tl.float32)
    for g in tl.static_range(G):
        lg = tl.load(rank_ptr + (qrow0 + g) * C + idx, mask=valid, other=float("-inf"))
        m_g = tl.sum(tl.where(offs_g == g, m, 0.0), axis=0)
        inv_z_g = tl.sum(tl.where(offs_g == g, inv_z, 0.0), axis=0)
        score += tl.exp(lg - m_g) * inv_z_g
        best = tl.maximum(best, lg)
    return tl.where(best > float("-inf"), score, float("-inf"))
