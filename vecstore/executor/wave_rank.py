"""Triton kernels that rank clusters: centroid logits, and the GQA-summed softmax score.

The score ranks by ``logit_j + rscale * |q_g| * r_j`` (``rscale = scale * w``, ``r_j`` the
cluster radius, :func:`vecstore.index.wave.bound_logits`). The logits kernel writes the plain
centroid logits, which the estimation zone uses, and, when radii are given, these ranking
logits beside them, so the score kernel only reads what it ranks.

The score kernel also runs the first pass of the radix select of
:mod:`vecstore.executor.wave_select` over the scores it writes, saving a read and a launch.
Rows are ``b * Hkv + h``; query rows ``(b * Hkv + h) * G + g``.
"""

from __future__ import annotations

import triton.language as tl

from vecstore.executor.wave_radix import radix_count, radix_keys
from vecstore.kernels._backend import LazyKernel

__all__ = ["LOGITS", "SCORE"]


def _logits_kernel(
    q_ptr, c_ptr, n_ptr, r_ptr, logits_ptr, rank_ptr, pmax_ptr, psum_ptr, C, split_len,
    num_splits, scale, rscale, G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_C: tl.constexpr, DOT_F32: tl.constexpr, RADIUS: tl.constexpr,
):
    # logits of the G query heads of a row against a split of its centroids (each centroid
    # read once per group), -inf for empty clusters; with RADIUS the ranking logits too; and
    # each head's max and sum of exp of the ranking logits
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < G
    qrows = row * G + offs_g
    q = tl.load(q_ptr + qrows[:, None] * D + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    qf = q.to(tl.float32)
    if DOT_F32:
        q = qf
    qn = tl.sqrt(tl.sum(qf * qf, axis=1))
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    s_i = tl.zeros([BLOCK_G], tl.float32)
    start = split * split_len
    end = tl.minimum(start + split_len, C)
    for c0 in range(start, end, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_mask = offs_c < end
        cent = tl.load(c_ptr + (row * C + offs_c)[:, None] * D + offs_d[None, :],
                       mask=c_mask[:, None], other=0.0)
        if DOT_F32:
            cent = cent.to(tl.float32)
        n = tl.load(n_ptr + row * C + offs_c, mask=c_mask, other=0)
        lg = tl.dot(q, tl.trans(cent)) * scale
        lg = tl.where((n > 0)[None, :], lg, float("-inf"))
        out_mask = g_mask[:, None] & c_mask[None, :]
        tl.store(logits_ptr + qrows[:, None] * C + offs_c[None, :], lg, mask=out_mask)
        rl = lg
        if RADIUS:
            r = tl.load(r_ptr + row * C + offs_c, mask=c_mask, other=0.0)
            rl = lg + rscale * qn[:, None] * r[None, :]
            tl.store(rank_ptr + qrows[:, None] * C + offs_c[None, :], rl, mask=out_mask)
        m_new = tl.maximum(m_i, tl.max(rl, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_i = s_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(rl - m_safe[:, None]), axis=1)
        m_i = m_new
    tl.store(pmax_ptr + qrows * num_splits + split, m_i, mask=g_mask)
    tl.store(psum_ptr + qrows * num_splits + split, s_i, mask=g_mask)


def _score_kernel(
    rank_ptr, pmax_ptr, psum_ptr, score_ptr, counts_ptr, C, num_splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    PASSES: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
):
    # ranking score sum_g softmax_g(ranking logits)_j of a chunk, then the first radix pass
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    g_mask = offs_g < G
    qrows = row * G + offs_g
    sm = g_mask[:, None] & (offs_s < num_splits)[None, :]
    pm = tl.load(pmax_ptr + qrows[:, None] * num_splits + offs_s[None, :], mask=sm,
                 other=float("-inf"))
    ps = tl.load(psum_ptr + qrows[:, None] * num_splits + offs_s[None, :], mask=sm, other=0.0)
    m = tl.max(pm, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    z = tl.sum(ps * tl.exp(pm - m[:, None]), axis=1)
    inv_z = 1.0 / tl.where(z > 0, z, 1.0)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = idx < C
    lg = tl.load(rank_ptr + qrows[:, None] * C + idx[None, :],
                 mask=g_mask[:, None] & valid[None, :], other=float("-inf"))
    sc = tl.sum(tl.exp(lg - m[:, None]) * inv_z[:, None], axis=0)
    sc = tl.where(tl.max(lg, axis=0) > float("-inf"), sc, float("-inf"))
    tl.store(score_ptr + row * C + idx, sc, mask=valid)
    key = radix_keys(sc)  # the first radix pass: no prefix yet, the same for k1 and k2
    hist = counts_ptr + row * 2 * PASSES * (1 << BITS)
    radix_count(key, valid, 0, hist, 0, BITS)
    radix_count(key, valid, 0, hist + PASSES * (1 << BITS), 0, BITS)


LOGITS = LazyKernel(_logits_kernel)
"""Grid ``(rows, splits)``: logits (and ranking logits) ``[rows * G, C]``, per-split max /
sum of exp."""
SCORE = LazyKernel(_score_kernel)
"""Grid ``(rows, chunks)``: score ``[rows, C]`` and the counts of radix pass 0."""
