"""Triton device functions of split-K decode attention, shared by the kernels and the executor.

The split kernels of :mod:`vecstore.kernels` and of :mod:`vecstore.executor.wave_kernels` serve
one query token per sequence with grouped-query attention: a program owns the ``G`` query heads
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
    "add_values",
    "store_state",
    "store_merged",
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
def add_values(acc, alpha, p, values, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    # acc [G, D] rescaled by alpha [G], plus the weights p [G, N] (rounded to the values' dtype)
    # times values [N, D]
    p_op = p.to(values.dtype)
    if DOT_F32:
        p_op = p_op.to(tl.float32)
        values = values.to(tl.float32)
    return acc * alpha[:, None] + tl.dot(p_op, values, input_precision=PRECISION)


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
