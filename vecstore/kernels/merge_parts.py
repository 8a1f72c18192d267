"""The merge of a decode step's partial attention states: every split of every zone.

Each split of the retrieved, steady and estimated zones writes a normalised partial state
``(out, lse)`` of a query row; :func:`combine` merges a row's ``P`` states by log-sum-exp
(as :func:`vecstore.kernels.reference.merge` does two at a time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecstore.kernels._device import store_merged
from vecstore.kernels.backend import LazyKernel

__all__ = ["combine"]

# the merge: partial outputs per step of its loop, head dims per program. 64 against 16, H200
# whole steps: 4 x 1M 0.369 against 0.372 ms, 8 x 128K and 1 x 1M the same; offloaded (twice
# the retrieved splits) 1 x 1M 0.373 against 0.401-0.407, 4 x 1M 1.264 against 1.286-1.288
_COMBINE_BLOCK = 64
_COMBINE_DIMS = 128


def _combine_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, P,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                    BLOCK_P: tl.constexpr):
    # head dims [d0, d0 + BLOCK_D) of a query row: the largest log-sum-exp BLOCK_L parts at a
    # time (one load for P up to BLOCK_L), then the partial outputs merged BLOCK_P at a time
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_l = tl.arange(0, BLOCK_L)
    m = tl.full([BLOCK_L], float("-inf"), tl.float32)
    for p0 in range(0, P, BLOCK_L):
        lp = tl.load(part_lse_ptr + row * P + p0 + offs_l, mask=p0 + offs_l < P,
                     other=float("-inf"))
        m = tl.maximum(m, lp)
    mx = tl.max(m, axis=0)
    m_safe = tl.where(mx == float("-inf"), 0.0, mx)
    offs_p = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_D], tl.float32)
    den = tl.zeros([BLOCK_P], tl.float32)
    for p0 in range(0, P, BLOCK_P):
        pm = p0 + offs_p < P
        w = tl.exp(tl.load(part_lse_ptr + row * P + p0 + offs_p, mask=pm, other=float("-inf"))
                   - m_safe)
        o = tl.load(part_out_ptr + (row * P + p0 + offs_p)[:, None] * D + offs_d[None, :],
                    mask=pm[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
        den += w
    # every head-dim block of the row stores the same lse
    store_merged(out_ptr, lse_ptr, row, offs_d, None, acc, tl.sum(den, axis=0), m_safe, D)


_COMBINE = LazyKernel(_combine_kernel)


def combine(parts: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor,
            lse: torch.Tensor) -> None:
    """Merge every partial state of a query row: ``out [rows * G, D]`` (any float dtype) and
    ``lse [rows * G]`` float32, written in place."""
    qrows, num_parts, dim = parts[0].shape
    block_d = min(dim, _COMBINE_DIMS)
    _COMBINE[(qrows, dim // block_d)](
        parts[0], parts[1], out, lse, num_parts, D=dim, BLOCK_D=block_d,
        BLOCK_L=min(256, max(16, triton.next_power_of_2(num_parts))), BLOCK_P=_COMBINE_BLOCK)
