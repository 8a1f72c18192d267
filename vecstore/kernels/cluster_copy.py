"""The Triton kernel of the wave buffer's cluster copies: whole clusters moved from the KV
rows into the execution buffer (a step's misses) or the block cache's slots (a new buffer's
:func:`~vecstore.buffer.cache_fill.warm`), and from the execution buffer into the cache
(admitted misses) (:class:`vecstore.buffer.WaveBuffer`).

The execution buffer holds a row's hits first, then its misses, each in retrieved order
(:class:`vecstore.kernels.exec_layout.ExecLayout`); the hits' places there are only mapped
to their cache rows (:mod:`vecstore.kernels.hit_map`), never copied. Rows are
``b * Hkv + h``.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from vecstore.kernels.backend import LazyKernel, num_sms, row_stride
from vecstore.kernels.exec_layout import ExecLayout

__all__ = ["copy_clusters"]

# rows per load of the cluster copies (H200, offloaded 1 x 1M: 16 rows 0.371 / 64 rows 0.380
# against 0.373 ms; 8 x 128K 0.372 / 0.379 against 0.374)
_COPY_BLOCK = 32
_COPY_WARPS = 4
# programs per SM copying misses, each looping over clusters: H200, offloaded steps against a
# program per cluster, 0.555 against 0.691 ms at 1 x 1M (2 per SM 0.661, 4 0.671), 1.745
# (2 per SM) against 2.025 at 4 x 1M. A program per cluster filled every SM with loads
# waiting on PCIe, and the hits copy and the admission bookkeeping waited behind them. Fewer
# are slower: 0.379 (1/2 per SM) and 0.389 ms (1/4) against 0.373 at 1 x 1M
_MISS_PROGRAMS_PER_SM = 1


def _copy_kernel(
    count_ptr, size_ptr, slot_ptr, pos_ptr, split_ptr, src_start_ptr,
    src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr,
    R_MAX, SRC_ROWS, DST_ROWS, SLOT_T,  # rows from one KV row's block to the next
    MODE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # MODE 0: misses, source rows -> execution buffer (split + pos; a warm's split is 0 and
    # its pos a slot's first row); MODE 1: admitted misses, execution buffer -> cache slot.
    # Program j of a row copies clusters j, j + programs, ... of it
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(count_ptr + row)
    split = tl.load(split_ptr + row)
    offs_d = tl.arange(0, D)
    for i in range(tl.program_id(1), count, tl.num_programs(1)):
        slot = tl.load(slot_ptr + row * R_MAX + i)
        n = tl.load(size_ptr + row * R_MAX + i)
        p0 = tl.load(pos_ptr + row * R_MAX + i)
        go = slot < 0 if MODE == 0 else slot >= 0
        if go:
            if MODE == 0:
                src0 = row * SRC_ROWS + tl.load(src_start_ptr + row * R_MAX + i)
                dst0 = row * DST_ROWS + split + p0
            else:
                src0 = row * SRC_ROWS + split + p0
                dst0 = (row * (DST_ROWS // SLOT_T) + slot) * SLOT_T
            for j in range(0, n, BLOCK_N):
                offs = j + tl.arange(0, BLOCK_N)
                m = offs < n
                so = (src0 + offs)[:, None] * D + offs_d[None, :]
                do = (dst0 + offs)[:, None] * D + offs_d[None, :]
                k = tl.load(src_k_ptr + so, mask=m[:, None])  # both loads in flight at once
                v = tl.load(src_v_ptr + so, mask=m[:, None])
                tl.store(dst_k_ptr + do, k, mask=m[:, None])
                tl.store(dst_v_ptr + do, v, mask=m[:, None])


_COPY = LazyKernel(_copy_kernel)


def copy_clusters(mode: int, layout: ExecLayout, slot: torch.Tensor,
                  src_start: torch.Tensor | None, src_k: torch.Tensor, src_v: torch.Tensor,
                  dst_k: torch.Tensor, dst_v: torch.Tensor, slot_tokens: int) -> None:
    """Move whole clusters between the tiers: a program per cluster, except for misses,
    which ``_MISS_PROGRAMS_PER_SM`` programs per SM copy in turn (so the loads waiting on
    PCIe leave SMs to the attention over the hits and the bookkeeping).

    ``mode`` 0 copies misses (``slot < 0``) from the KV rows ``src [rows, N, D]`` (GPU or
    pinned host memory, read zero-copy; cluster ``i`` of a row starts at row
    ``src_start [rows, R]``) to ``dst [rows, M, D]`` at row ``split + pos`` (the execution
    buffer); 1 copies clusters given a slot (``slot >= 0``) from the execution buffer
    ``src`` to the cache ``dst [rows, S * T, D]``. ``slot`` is ``[rows, R]`` int32;
    ``layout`` places each cluster in the execution buffer.
    """
    rows, r_max = slot.shape
    programs = r_max
    if mode == 0:
        programs = min(r_max, math.ceil(_MISS_PROGRAMS_PER_SM * num_sms(slot.device) / rows))
    _COPY[(rows, programs)](
        layout.count, layout.size, slot, layout.pos, layout.split,
        src_start if src_start is not None else slot, src_k, src_v, dst_k, dst_v,
        r_max, row_stride(src_k, src_v), row_stride(dst_k, dst_v), slot_tokens,
        MODE=mode, D=src_k.shape[2], BLOCK_N=_COPY_BLOCK, num_warps=_COPY_WARPS,
    )
