"""Triton kernels that rank clusters: centroid logits, and the GQA-summed softmax score.

The score ranks by ``logit_j + rscale * |q_g| * r_j`` (``rscale = scale * w``, ``r_j`` the
cluster radius, :func:`vecstore.index.wave.bound_logits`). The logits kernel writes the plain
centroid logits, which the estimation zone uses, and, when radii are given, these ranking
logits beside them, so the score kernel only reads what it ranks.

The score kernel also runs the first pass of the radix select of
:mod:`vecstore.executor.wave_select` over the scores it writes, saving a read and a launch.
The estimation zone reads the logits as weights ``logit + log n_j`` (the logits kernel
writes them beside the ranking logits), so it needs no cluster sizes of its own.
Rows are ``b * Hkv + h``; query rows ``(b * Hkv + h) * G + g``.
"""

from __future__ import annotations

import triton.language as tl

from vecstore.executor.wave_radix import radix_count, radix_keys
from vecstore.kernels._backend import LazyKernel
from vecstore.kernels._device import load_queries, query_group
from vecstore.kernels._rank_device import centroid_logits, group_score, softmax_norm, sum_exp_step

__all__ = ["LOGITS", "SCORE"]


def _logits_kernel(
    q_ptr, c_ptr, cs_ptr, n_ptr, r_ptr, weight_ptr, rank_ptr, pmax_ptr, psum_ptr, C,
    split_len, num_splits, scale, rscale, G: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, DOT_F32: tl.constexpr,
    RADIUS: tl.constexpr, SQ8: tl.constexpr,
):
    # logits of the G query heads of a row against a split of its centroids (each centroid
    # read once per group; with SQ8 int8 codes times their scales cs), -inf for empty
    # clusters: the ranking logits (with RADIUS plus the radius term), the estimation weights
    # logit + log size, and each head's max and sum of exp of the ranking logits
    row, split, offs_d, qrows, g_mask = query_group(G, BLOCK_G, D)
    q = load_queries(q_ptr, qrows, offs_d, g_mask[:, None], D, False)
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
        lg = centroid_logits(q, c_ptr, n_ptr, row, C, offs_c, c_mask, c_mask[:, None], offs_d,
                             scale, D, None)  # None: Triton's default dot precision
        if SQ8:
            cs = tl.load(cs_ptr + row * C + offs_c, mask=c_mask, other=1.0)
            lg = tl.where(lg > float("-inf"), lg * cs[None, :], lg)
        out_mask = g_mask[:, None] & c_mask[None, :]
        out = qrows[:, None] * C + offs_c[None, :]
        n = tl.load(n_ptr + row * C + offs_c, mask=c_mask, other=1)
        # an empty cluster's logit is already -inf
        tl.store(weight_ptr + out, lg + tl.log(tl.maximum(n, 1).to(tl.float32))[None, :],
                 mask=out_mask)
        rl = lg
        if RADIUS:
            r = tl.load(r_ptr + row * C + offs_c, mask=c_mask, other=0.0)
            rl = lg + rscale * qn[:, None] * r[None, :]
        tl.store(rank_ptr + out, rl, mask=out_mask)
        m_i, s_i = sum_exp_step(rl, m_i, s_i)
    tl.store(pmax_ptr + qrows * num_splits + split, m_i, mask=g_mask)
    tl.store(psum_ptr + qrows * num_splits + split, s_i, mask=g_mask)


def _score_kernel(
    rank_ptr, pmax_ptr, psum_ptr, score_ptr, counts_ptr, C, num_splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    PASSES: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
):
    # ranking score sum_g softmax_g(ranking logits)_j of a chunk, then the first radix pass
    row, chunk, offs_s, qrows, g_mask = query_group(G, BLOCK_G, BLOCK_S)
    sm = g_mask[:, None] & (offs_s < num_splits)[None, :]
    pm = tl.load(pmax_ptr + qrows[:, None] * num_splits + offs_s[None, :], mask=sm,
                 other=float("-inf"))
    ps = tl.load(psum_ptr + qrows[:, None] * num_splits + offs_s[None, :], mask=sm, other=0.0)
    m, inv_z = softmax_norm(pm, ps)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = idx < C
    lg = tl.load(rank_ptr + qrows[:, None] * C + idx[None, :],
                 mask=g_mask[:, None] & valid[None, :], other=float("-inf"))
    sc = group_score(lg, m, inv_z)
    tl.store(score_ptr + row * C + idx, sc, mask=valid)
    key = radix_keys(sc)  # the first radix pass: no prefix yet, the same for k1 and k2
    hist = counts_ptr + row * 2 * PASSES * (1 << BITS)
    radix_count(key, valid, 0, 0, hist, hist + PASSES * (1 << BITS), 0, BITS)


LOGITS = LazyKernel(_logits_kernel)
"""Grid ``(rows, splits)``: ranking logits and estimation weights ``[rows * G, C]``,
per-split max / sum of exp."""
SCORE = LazyKernel(_score_kernel)
"""Grid ``(rows, chunks)``: score ``[rows, C]`` and the counts of radix pass 0."""
