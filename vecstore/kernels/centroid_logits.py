"""The index probe's bandwidth-bound part: every cluster's centroid logits for every query head.

:func:`centroid_logits` reads each centroid once per GQA group (one ``tl.dot`` per tile) and
writes the ranking logits ``logit_j + rscale * |q_g| * r_j`` (``rscale = scale * w``, ``r_j``
the cluster radius, :func:`vecstore.index.wave.bound_logits`), the estimation zone's weights
``logit_j + log n_j`` beside them, and each head's running max and sum of exponentials of the
ranking logits per split of the clusters, from which :mod:`vecstore.kernels.zone_select`
scores the clusters. Centroids are float, or int8 codes with a scale each
(:mod:`vecstore.executor.sq8`). With ``SOFTCAP`` the weights' logits are soft-capped,
``softcap * tanh(logit / softcap)``, as the exact zones' scores are, while the ranking logits
stay uncapped (the cap is monotonic); without it the kernel compiles as before.

Rows are ``b * Hkv + h``; query rows ``(b * Hkv + h) * G + g`` (``[B, Hq]`` flattened).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vecstore.kernels._device import load_queries, query_group, soft_cap
from vecstore.kernels._rank_device import sum_exp_step, tile_logits
from vecstore.kernels.backend import LazyKernel, needs_f32_dot, num_sms

__all__ = ["Logits", "centroid_logits"]

# the logits kernel: centroids per tile, programs per SM the splits aim at, warps, pipeline
# stages; H200 whole steps, against 64 / 4 / 4 / 3: 159 against 164 us at 8 x 128K, 458
# against 465 at 8 x 512K, 465 against 479 at 4 x 1M (tiles of 32 or 128, 8 warps, 4 stages
# all slower)
_BLOCK_LOGITS = 64
_LOGITS_PER_SM = 8
_LOGITS_WARPS = 4
_LOGITS_STAGES = 2
# int8 centroid codes: tiles of 128 (the bytes of 64 bfloat16 centroids) and 3 stages; H200
# whole steps 0.393 / 0.386 / 0.700 ms at 8 x 512K / 4 x 1M / 8 x 1M against 0.452 / 0.448 /
# 0.816 with the bfloat16 tiling (128 / 2: 0.413 / 0.405 / 0.735; 128 / 4, 256 / 3 slower)
_SQ8_BLOCK_LOGITS = 128
_SQ8_LOGITS_STAGES = 3
# splits of a row at most: 0.164 against 0.175 ms at 1 x 1M with 128 instead of 64 (8 rows fill
# the SMs), the same at 8 x 128K, 4 x 1M, 8 x 1M
_LOGITS_MAX_SPLITS = 128


def _logits_kernel(
    q_ptr, c_ptr, cs_ptr, n_ptr, r_ptr, weight_ptr, rank_ptr, pmax_ptr, psum_ptr, C,
    split_len, num_splits, scale, rscale, softcap, G: tl.constexpr, D: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, DOT_F32: tl.constexpr,
    RADIUS: tl.constexpr, SQ8: tl.constexpr, SOFTCAP: tl.constexpr,
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
        lg = tile_logits(q, c_ptr, n_ptr, row, C, offs_c, c_mask, c_mask[:, None], offs_d,
                         scale, D, None)  # None: Triton's default dot precision
        if SQ8:
            cs = tl.load(cs_ptr + row * C + offs_c, mask=c_mask, other=1.0)
            lg = tl.where(lg > float("-inf"), lg * cs[None, :], lg)
        out_mask = g_mask[:, None] & c_mask[None, :]
        out = qrows[:, None] * C + offs_c[None, :]
        n = tl.load(n_ptr + row * C + offs_c, mask=c_mask, other=1)
        # an empty cluster's logit is already -inf (and stays so capped)
        lw = lg
        if SOFTCAP:
            lw = tl.where(lg > float("-inf"), soft_cap(lg, softcap), lg)
        tl.store(weight_ptr + out, lw + tl.log(tl.maximum(n, 1).to(tl.float32))[None, :],
                 mask=out_mask)
        rl = lg
        if RADIUS:
            r = tl.load(r_ptr + row * C + offs_c, mask=c_mask, other=0.0)
            rl = lg + rscale * qn[:, None] * r[None, :]
        tl.store(rank_ptr + out, rl, mask=out_mask)
        m_i, s_i = sum_exp_step(rl, m_i, s_i)
    tl.store(pmax_ptr + qrows * num_splits + split, m_i, mask=g_mask)
    tl.store(psum_ptr + qrows * num_splits + split, s_i, mask=g_mask)


_LOGITS = LazyKernel(_logits_kernel)


@dataclass(frozen=True, slots=True)
class Logits:
    """What :func:`centroid_logits` leaves for
    :func:`~vecstore.kernels.zone_select.select_ranked`: the ranking logits
    ``rank [rows * G, C]`` and, per query row and split of the clusters, the running max and
    sum of their exponentials ``pmax``/``psum [rows * G, splits]`` (float32)."""

    rank: torch.Tensor
    pmax: torch.Tensor
    psum: torch.Tensor


def centroid_logits(q: torch.Tensor, centroids: torch.Tensor, radii: torch.Tensor | None,
                    sizes: torch.Tensor, scale: float, radius_weight: float,
                    weights: torch.Tensor, code_scales: torch.Tensor | None = None,
                    softcap: float | None = None) -> Logits:
    """Score every cluster for every query head (the index probe's bandwidth-bound part).

    Parameters
    ----------
    q : torch.Tensor
        ``[rows * G, D]`` queries, the centroids' dtype (a float dtype for int8 centroids).
    centroids : torch.Tensor
        ``[rows, C, D]``, float, or int8 codes with ``code_scales``
        (:mod:`~vecstore.executor.sq8`).
    radii : torch.Tensor | None
        ``[rows, C]`` float32 cluster radii; ``None`` ranks by the centroids alone.
    sizes : torch.Tensor
        ``[rows, C]`` int32.
    radius_weight : float
        Weight of the radius in the ranking logit ``scale * (q . c_j + w * |q| * r_j)``.
    weights : torch.Tensor
        ``[rows * G, C]`` float32, written: the estimation zone's log weights
        ``scale * q . c_j + log n_j``, ``-inf`` for empty clusters.
    code_scales : torch.Tensor | None
        ``[rows, C]`` float32 scales of int8 ``centroids``.
    softcap : float | None
        Attention logit soft-cap of the estimation weights' logits,
        ``softcap * tanh(scale * q . c_j / softcap) + log n_j``; the ranking logits are
        not capped (the cap is monotonic). ``None``: no cap.
    """
    rows, num_clusters, dim = centroids.shape
    group = q.shape[0] // rows
    dev = q.device
    sq8 = code_scales is not None
    tile = _SQ8_BLOCK_LOGITS if sq8 else _BLOCK_LOGITS
    blocks = triton.cdiv(num_clusters, tile)
    splits = max(1, min(blocks, _LOGITS_MAX_SPLITS,
                        triton.cdiv(_LOGITS_PER_SM * num_sms(dev), rows)))
    split_len = triton.cdiv(blocks, splits) * tile
    splits = triton.cdiv(num_clusters, split_len)
    pmax = torch.empty(rows * group, splits, dtype=torch.float32, device=dev)
    psum = torch.empty_like(pmax)
    use_radius = radius_weight != 0.0 and radii is not None
    rank = torch.empty_like(weights)
    r = radii if use_radius else weights  # any pointer; unread without RADIUS
    _LOGITS[(rows, splits)](q, centroids, code_scales if sq8 else weights, sizes, r, weights,
                             rank, pmax, psum, num_clusters, split_len, splits, scale,
                             scale * radius_weight, softcap or 1.0, G=group, D=dim,
                             BLOCK_G=max(16, triton.next_power_of_2(group)),
                             BLOCK_C=tile, DOT_F32=needs_f32_dot(q.dtype),
                             RADIUS=use_radius, SQ8=sq8, SOFTCAP=softcap is not None,
                             num_warps=_LOGITS_WARPS,
                             num_stages=_SQ8_LOGITS_STAGES if sq8 else _LOGITS_STAGES)
    return Logits(rank, pmax, psum)
