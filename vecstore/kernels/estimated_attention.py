"""Split-K attention over the estimation zone: clusters approximated by centroid and value mean.

RetroInfer (Chen et al., 2025) approximates every key of an estimated cluster ``j`` by its
centroid: the cluster weighs ``exp(s q . c_j + log n_j)`` (the weights
:func:`vecstore.kernels.centroid_logits.centroid_logits` wrote) on its value mean
``VS_j / n_j``. Each split of a row's compacted estimated clusters writes a partial
``(out, lse)``; :func:`vecstore.kernels.merge_parts.combine` merges them.

Rows are ``b * Hkv + h``; query rows ``(b * Hkv + h) * G + g``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecstore.kernels._device import empty_state, query_group, softmax_step, store_state
from vecstore.kernels.backend import LazyKernel, needs_f32_dot
from vecstore.kernels.zones import Zones

__all__ = ["ESTIMATE_SPLIT", "estimate_layout", "attend_estimated"]

ESTIMATE_SPLIT = 256  # clusters per split at least
_BLOCK_E = 128
# splits per row the estimation zone aims at (each >= ESTIMATE_SPLIT), and its warps; H200
# whole steps at 8 x 128K / 8 x 512K / 4 x 1M / 8 x 1M, against 32 splits of 64-cluster
# tiles: 0.150 / 0.423 / 0.421 / 0.768 ms against 0.151 / 0.434 / 0.427 / 0.786 (16 splits
# of 64: 0.151 / 0.426 / 0.421 / 0.777; 32 of 128: 0.151 / 0.433 / 0.424 / 0.773). Earlier,
# with 64-cluster tiles: 64 or 128 splits and 8 warps slower, retrieved splits of 256 or 1024
# rows no faster. With int8 centroid codes and two pipelined row groups, 12 splits: 0.376 /
# 0.370 / 0.679 ms at 8 x 512K / 4 x 1M / 8 x 1M against 0.381 / 0.371 / 0.694 with 16 (8:
# 0.373 / 0.379 / 0.677)
_ESTIMATE_SPLITS = 12
_ESTIMATE_WARPS = 4
# pipeline stages of the estimation's loop: 0.424 ms at 4 x 1M against 0.444 with 2 and 0.424
# with 4; 0.779 against 0.813 / 0.780 at 8 x 1M
_ESTIMATE_STAGES = 3


def _estimated_kernel(
    weight_ptr, vmean_ptr, est_ptr, est_count_ptr, part_out_ptr, part_lse_ptr,
    C, E_MAX, split_base, num_parts, split_len,
    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    # positions [split * split_len, ...) of the row's compacted estimated clusters
    row, split, offs_d, qrows, g_mask = query_group(G, BLOCK_G, D)
    e0 = split * split_len
    e1 = tl.minimum(e0 + split_len, tl.load(est_count_ptr + row))
    m_i, l_i, acc = empty_state(BLOCK_G, D)
    for e in range(e0, e1, BLOCK_E):
        pos = e + tl.arange(0, BLOCK_E)
        use = pos < e1
        idx = tl.load(est_ptr + row * E_MAX + pos, mask=use, other=0).to(tl.int64)
        w = tl.load(weight_ptr + qrows[:, None] * C + idx[None, :],
                    mask=g_mask[:, None] & use[None, :], other=float("-inf"))
        vm = tl.load(vmean_ptr + (row * C + idx)[:, None] * D + offs_d[None, :],
                     mask=use[:, None], other=0.0)
        if DOT_F32:
            vm = vm.to(tl.float32)
        m_i, l_i, acc = softmax_step(w, vm, m_i, l_i, acc)
    store_state(part_out_ptr, part_lse_ptr, qrows, g_mask, g_mask[:, None], offs_d,
                split_base + split, num_parts, m_i, l_i, acc, D)


_ESTIMATED = LazyKernel(_estimated_kernel)


def estimate_layout(e_max: int) -> tuple[int, int]:
    """``(positions per split, splits)`` of an estimation zone of at most ``e_max`` clusters."""
    per = max(ESTIMATE_SPLIT,
              triton.cdiv(triton.cdiv(e_max, _ESTIMATE_SPLITS), _BLOCK_E) * _BLOCK_E)
    return per, max(1, triton.cdiv(e_max, per))


def attend_estimated(weights: torch.Tensor, vmean: torch.Tensor, zones: Zones,
                     parts: tuple[torch.Tensor, torch.Tensor], split_base: int) -> None:
    """Partial states of the estimated clusters (``zones.est_ids``): log weights
    ``logit + log size`` ``[rows * G, C]`` float32 (as
    :func:`~vecstore.kernels.centroid_logits.centroid_logits` writes them), value means
    ``vmean [rows, C, D]``."""
    rows, num_clusters, dim = vmean.shape
    group = weights.shape[0] // rows
    e_max = zones.est_ids.shape[1]
    per, num_splits = estimate_layout(e_max)
    _ESTIMATED[(rows, num_splits)](
        weights, vmean, zones.est_ids, zones.est_count, parts[0], parts[1],
        num_clusters, e_max, split_base, parts[1].shape[1], per,
        G=group, D=dim, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_E=_BLOCK_E,
        DOT_F32=needs_f32_dot(vmean.dtype), num_warps=_ESTIMATE_WARPS,
        num_stages=_ESTIMATE_STAGES,
    )
