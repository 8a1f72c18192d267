"""Where an offloaded step's hits are read: their rows in the block cache, in place.

The execution buffer of a :class:`vecstore.buffer.WaveBuffer` places a row's hits first
(positions ``0:split``), then its misses (:class:`vecstore.kernels.exec_layout.ExecLayout`).
The misses are copied there from host memory; the hits are not copied at all: the retrieved
attention reads them from their cache slots through the map this kernel writes (position
``pos[i] + j`` of hit ``i`` holds cache row ``slot[i] * slot_tokens + j``), as a resident
view's retrieved rows are read in place through
:func:`~vecstore.kernels.retrieved_attention.fill_rowmap`. Rows are ``b * Hkv + h``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecstore.kernels.backend import LazyKernel
from vecstore.kernels.exec_layout import ExecLayout

__all__ = ["map_hits"]

_CLUSTERS = 32  # retrieved clusters per program (clusters hold ~16 rows)


def _hit_map_kernel(count_ptr, size_ptr, pos_ptr, slot_ptr, map_ptr, R_MAX, M, SLOT_T,
                    BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr):
    # BLOCK_I retrieved clusters of a row at once, a [BLOCK_I, BLOCK_N] tile of their rows
    # per step; misses (slot < 0) and positions past the row's count are left as they were
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    inside = i < tl.load(count_ptr + row)
    slot = tl.load(slot_ptr + row * R_MAX + i, mask=inside, other=-1)
    hit = inside & (slot >= 0)
    n = tl.load(size_ptr + row * R_MAX + i, mask=hit, other=0)
    p0 = tl.load(pos_ptr + row * R_MAX + i, mask=hit, other=0)
    first = slot * SLOT_T
    for j in range(0, tl.max(n, axis=0), BLOCK_N):
        offs = j + tl.arange(0, BLOCK_N)
        tl.store(map_ptr + row * M + p0[:, None] + offs[None, :], first[:, None] + offs[None, :],
                 mask=offs[None, :] < n[:, None])


_HIT_MAP = LazyKernel(_hit_map_kernel)


def map_hits(layout: ExecLayout, slot: torch.Tensor, hit_map: torch.Tensor,
             slot_tokens: int) -> None:
    """Write the cache row behind each hit position: ``hit_map [rows, M]`` int32, position
    ``layout.pos[i] + j`` of a hit ``i`` (``slot [rows, R]`` >= 0) holding
    ``slot[i] * slot_tokens + j``; other positions are left as they were."""
    rows, r_max = slot.shape
    _HIT_MAP[(rows, triton.cdiv(r_max, _CLUSTERS))](
        layout.count, layout.size, layout.pos, slot, hit_map, r_max, hit_map.shape[1],
        slot_tokens, BLOCK_I=_CLUSTERS, BLOCK_N=16)
