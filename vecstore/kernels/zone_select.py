"""The index probe's latency-bound part: the clusters' ranking score, then the zones.

:func:`select_ranked` fuses the GQA-summed softmax score (from the logits and per-split
statistics :func:`vecstore.kernels.centroid_logits.centroid_logits` wrote) with the first
radix pass, then finds the ``k1``-th and ``k2``-th largest scores by a radix select (no sort;
:func:`vecstore.kernels.radix_select.radix_thresholds`, which also records both thresholds
per row) and writes the zones (:func:`vecstore.kernels.zone_write.write_zones`).
:func:`select_zones` does the same from a given score.

Rows are ``b * Hkv + h``; query rows ``(b * Hkv + h) * G + g`` (``[B, Hq]`` flattened).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vecstore.kernels._device import query_group
from vecstore.kernels._rank_device import group_score, softmax_norm
from vecstore.kernels.backend import LazyKernel
from vecstore.kernels.centroid_logits import Logits
from vecstore.kernels.radix_select import RADIX_BITS, RADIX_PASSES, radix_count, radix_keys
from vecstore.kernels.zone_write import select_grid, write_zones
from vecstore.kernels.zones import Zones

__all__ = ["select_ranked", "select_zones"]


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
    sc = group_score(rank_ptr, row * G, C, idx, valid, m, inv_z, tl.arange(0, BLOCK_G), G)
    tl.store(score_ptr + row * C + idx, sc, mask=valid)
    key = radix_keys(sc)  # the first radix pass: no prefix yet, the same for k1 and k2
    hist = counts_ptr + row * 2 * PASSES * (1 << BITS)
    radix_count(key, valid, 0, 0, hist, hist + PASSES * (1 << BITS), 0, BITS)


_SCORE = LazyKernel(_score_kernel)


def select_ranked(logits: Logits, sizes: torch.Tensor, first_row: torch.Tensor,
                  k1: torch.Tensor, k2: torch.Tensor, out: Zones) -> None:
    """The GQA-summed softmax score of every cluster, then the zones, as by
    :func:`select_zones` (the index probe's latency-bound part).

    Parameters
    ----------
    logits : Logits
        From :func:`~vecstore.kernels.centroid_logits.centroid_logits`.
    sizes, first_row : torch.Tensor
        ``[rows, C]`` int32.
    k1, k2 : torch.Tensor
        ``[rows]`` int32 retrieved, and retrieved plus estimated, clusters.
    out : Zones
        Written, as by :func:`select_zones`.
    """
    rows, num_clusters = sizes.shape
    group = logits.rank.shape[0] // rows
    splits = logits.pmax.shape[1]
    dev = sizes.device
    score = torch.empty(rows, num_clusters, dtype=torch.float32, device=dev)
    block, nchunk = select_grid(num_clusters)
    counts, ncand = _radix_counts(rows, dev)
    _SCORE[(rows, nchunk)](logits.rank, logits.pmax, logits.psum, score, counts, num_clusters,
                           splits, G=group, BLOCK_G=triton.next_power_of_2(group),
                           BLOCK_S=triton.next_power_of_2(splits), PASSES=RADIX_PASSES,
                           BITS=RADIX_BITS, BLOCK=block)
    write_zones(score, sizes, first_row, k1, k2, counts, ncand, 1, out)


def select_zones(score: torch.Tensor, sizes: torch.Tensor, first_row: torch.Tensor,
                 k1: torch.Tensor, k2: torch.Tensor, out: Zones) -> None:
    """Mark the ``k1`` best clusters of each row retrieved and the next ``k2 - k1`` estimated.

    Ranks are by score, ties by cluster id (a stable top-k). Radix passes of ``RADIX_BITS``
    bits find both thresholds with every (row, chunk) in parallel; then per-chunk counts, one
    scan per row, and a parallel write of the zones and the compacted retrieved and
    estimated ids.

    Parameters
    ----------
    score : torch.Tensor
        ``[rows, C]`` float32 ranking score (higher first, ``-inf`` never taken).
    sizes, first_row : torch.Tensor
        ``[rows, C]`` int32 cluster sizes and first KV rows.
    k1, k2 : torch.Tensor
        ``[rows]`` int32, ``0 <= k1 <= k2 <= C``.
    out : Zones
        Written in place.
    """
    counts, ncand = _radix_counts(score.shape[0], score.device)
    write_zones(score, sizes, first_row, k1, k2, counts, ncand, 0, out)


def _radix_counts(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # the radix histograms [rows, 2, RADIX_PASSES, 2**RADIX_BITS] and candidate counts
    # [rows, 2], zeroed by one fill
    bins = rows * 2 * RADIX_PASSES << RADIX_BITS
    both = torch.zeros(bins + rows * 2, dtype=torch.int32, device=device)
    return (both[:bins].view(rows, 2, RADIX_PASSES, 1 << RADIX_BITS),
            both[bins:].view(rows, 2))
