"""Split-K attention over the steady zone: the sinks and the tokens not indexed yet, exactly.

Each split writes a partial ``(out, lse)``; :func:`vecstore.kernels.merge_parts.combine`
merges them with the other zones'. With ``SOFTCAP`` the scores are soft-capped,
``softcap * tanh(s / softcap)`` (Gemma 2); without it the kernel compiles as before. Rows
are ``b * Hkv + h``; query rows ``(b * Hkv + h) * G + g``.
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
from vecstore.kernels.backend import LazyKernel, needs_f32_dot

__all__ = ["STEADY_SPLIT", "steady_splits", "attend_steady"]

STEADY_SPLIT = 256  # rows per split
_BLOCK_N = 64


def _steady_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, part_out_ptr, part_lse_ptr,
    H, S, scale, softcap, split_base, num_parts, split_len,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, SOFTCAP: tl.constexpr,
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
        m_i, l_i, acc = attend_rows(q, k_ptr, v_ptr, kv_off, pmask, scale, softcap, m_i, l_i,
                                    acc, DOT_F32, SOFTCAP)
    store_state(part_out_ptr, part_lse_ptr, qrows, g_mask, g_mask[:, None], offs_d,
                split_base + split, num_parts, m_i, l_i, acc, D)


# where the steady parts start among a step's parts moves as the retrieved zone grows:
# specialising on it compiled the kernel again at a segment flush (0.6 s on the H200)
_STEADY = LazyKernel(_steady_kernel, do_not_specialize=("split_base", "num_parts"))


def steady_splits(capacity: int) -> int:
    """Splits of a steady zone of at most ``capacity`` rows."""
    return max(1, triton.cdiv(capacity, STEADY_SPLIT))


def attend_steady(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  lengths: torch.Tensor, scale: float,
                  parts: tuple[torch.Tensor, torch.Tensor], split_base: int,
                  softcap: float | None = None) -> None:
    """Partial states of the steady zone ``keys``/``values`` ``[B, Hkv, S, D]`` (valid rows
    ``lengths [B]``); ``softcap`` soft-caps the scores (``None``: no cap)."""
    batch, heads, cap, dim = keys.shape
    rows = batch * heads
    group = q.shape[0] // rows
    _STEADY[(rows, steady_splits(cap))](
        q, keys, values, lengths, parts[0], parts[1], heads, cap, scale, softcap or 1.0,
        split_base, parts[1].shape[1], STEADY_SPLIT,
        G=group, D=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=_BLOCK_N,
        DOT_F32=needs_f32_dot(keys.dtype), SOFTCAP=softcap is not None,
    )
