"""Triton device functions shared by the decode kernels of this package.

The split kernels (the three zones' attention, the index probe) serve one query token per
sequence with grouped-query attention: a program owns the ``G`` query heads
of a KV head ``row = b * Hkv + h`` (query rows ``row * G + g``) over one split of a reduction,
keeps an online-softmax state (running max ``m``, sum of exponentials ``l``, weighted sum of
values ``acc``) and writes it as a normalised partial state ``(out, lse)``; a combine kernel
then merges the partial states of every query row by log-sum-exp.

Plain ``@triton.jit`` functions: Triton inlines them into the kernels that call them.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "query_group",
    "load_queries",
    "empty_state",
    "softmax_step",
    "attend_rows",
    "store_state",
    "store_merged",
    "soft_cap",
]


@triton.jit
def query_group(G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK: tl.constexpr):
    # this program's row b * Hkv + h (int64: offsets into large stores exceed 2**31) and split
    # (grid axis 1); the offsets 0..BLOCK-1 along a tile's inner dimension (head dim, splits);
    # the query rows of the row's G heads and which of the BLOCK_G lanes hold one
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs = tl.arange(0, BLOCK)
    g_mask = offs_g < G
    return row, split, offs, row * G + offs_g, g_mask


@triton.jit
def load_queries(q_ptr, qrows, offs_d, mask, D: tl.constexpr, DOT_F32: tl.constexpr):
    # the queries [BLOCK_G, BLOCK_D] of a group (0 where masked), float32 for DOT_F32 dots
    q = tl.load(q_ptr + qrows[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    return q


@triton.jit
def empty_state(BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    # the online-softmax state (m, l, acc) of no rows yet
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    return m_i, l_i, acc


@triton.jit
def softmax_step(s, v, m_i, l_i, acc):
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
def attend_rows(q, k_ptr, v_ptr, kv_off, pmask, scale, softcap, m_i, l_i, acc,
                DOT_F32: tl.constexpr, SOFTCAP: tl.constexpr):
    # one tile of exact attention: rows kv_off [N, D] of K and V, valid where pmask; with
    # SOFTCAP the scores soft-capped (soft_cap; without it softcap is not read)
    k = tl.load(k_ptr + kv_off, mask=pmask[:, None], other=0.0)
    v = tl.load(v_ptr + kv_off, mask=pmask[:, None], other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * scale
    if SOFTCAP:
        s = soft_cap(s, softcap)
    s = tl.where(pmask[None, :], s, float("-inf"))
    return softmax_step(s, v, m_i, l_i, acc)


@triton.jit
def store_state(
    part_out_ptr,
    part_lse_ptr,
    qrows,
    g_mask,
    out_mask,
    offs_d,
    part,
    num_parts,
    m_i,
    l_i,
    acc,
    D: tl.constexpr,
):
    # the partial (out, lse) of a query row group, part `part` of `num_parts` per query row;
    # out 0 and lse -inf where nothing was attended
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    prow = qrows * num_parts + part
    tl.store(
        part_out_ptr + prow[:, None] * D + offs_d[None, :], acc / l_safe[:, None], mask=out_mask
    )
    tl.store(part_lse_ptr + prow, tl.where(has, m_i + tl.log(l_safe), float("-inf")), mask=g_mask)


@triton.jit
def store_merged(out_ptr, lse_ptr, row, offs_d, out_mask, acc, den, m_safe, D: tl.constexpr):
    # the merged (out, lse) of a query row from the sum acc [D] of its partial outputs weighted
    # by exp(lse - m_safe) and the sum den of those weights; out 0 and lse -inf where den is 0
    has = den > 0
    den_safe = tl.where(has, den, 1.0)
    tl.store(
        out_ptr + row * D + offs_d, (acc / den_safe).to(out_ptr.dtype.element_ty), mask=out_mask
    )
    tl.store(lse_ptr + row, tl.where(has, m_safe + tl.log(den_safe), float("-inf")))


@triton.jit
def soft_cap(s, softcap):
    # attention logits soft-capped, softcap * tanh(s / softcap), from exp (libdevice's tanh
    # has no interpreter version); -inf becomes -softcap: mask after capping
    e = tl.exp(-2.0 * tl.abs(s) / softcap)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(s < 0, -t, t) * softcap
