"""Score every cluster centroid against the query and pick each KV head's top clusters.

This is the index probe of RetroInfer's wave index (Chen et al., 2025, "RetroInfer: A
Vector-Storage Approach for Scalable Long-Context LLM Inference"): logits ``s * q . c_j`` for
every query head, then a ranking shared by the query heads of a GQA group, the softmax over
clusters summed over the group, so that one KV head fetches one set of clusters.
"""

from __future__ import annotations

import torch

from vecstore.errors import InvalidValueError, ShapeError
from vecstore.kernels._backend import Backend, resolve_backend
from vecstore.kernels._validate import (
    check_scale,
    float_input,
    group_size,
    int_input,
    output_pair,
    same_device,
)

__all__ = ["score_centroids", "select_top"]


def score_centroids(
    q: torch.Tensor,
    centroids: torch.Tensor,
    sizes: torch.Tensor,
    scale: float,
    k: int,
    *,
    backend: Backend = "auto",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score clusters for one query token per sequence and select the top ``k`` per KV head.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hq, D]`` query, float32, float16 or bfloat16.
    centroids : torch.Tensor
        ``[B, Hkv, C, D]`` cluster centroids, same dtype as ``q``. ``Hkv`` divides ``Hq``.
    sizes : torch.Tensor
        ``[B, Hkv, C]`` integer cluster sizes; a cluster of size ``<= 0`` is padding: its logit
        is ``-inf`` and it is never selected.
    scale : float
        Softmax scale, usually ``1 / sqrt(D)``.
    k : int
        Clusters to select per KV head, ``0 <= k <= C``.
    backend : {"auto", "triton", "torch"}
        ``"auto"`` runs Triton on CUDA tensors and torch otherwise.
    out : tuple of torch.Tensor, optional
        Preallocated ``(logits, top_ids)`` to write (contiguous, same device, the shapes and dtypes
        below), e.g. for CUDA graphs; new tensors when omitted.

    Returns
    -------
    logits : torch.Tensor
        ``[B, Hq, C]`` float32 ``scale * q . c_j`` (computed with float32 accumulation),
        ``-inf`` for empty clusters.
    top_ids : torch.Tensor
        ``[B, Hkv, k]`` int64 cluster ids, best first by ``sum_g softmax_j(logits[g])`` over the
        ``G = Hq / Hkv`` query heads of the group (ties in any order). When fewer than ``k``
        clusters are non-empty, the tail is ``-1``.

    Raises
    ------
    ShapeError
        If a shape, dtype or device does not match.
    InvalidValueError
        If ``k`` or ``scale`` is out of range or ``backend`` is unknown.
    BackendUnavailableError
        If ``backend="triton"`` cannot run here.

    Examples
    --------
    >>> import torch
    >>> q = torch.tensor([[[1.0, 0.0]]])                     # B=1, Hq=1, D=2
    >>> cents = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]]]])
    >>> sizes = torch.tensor([[[4, 4, 0]]])                  # cluster 2 is padding
    >>> logits, top = score_centroids(q, cents, sizes, 1.0, 2)
    >>> logits.tolist(), top.tolist()
    ([[[1.0, 0.0, -inf]]], [[[0, 1]]])
    """
    q = float_input(q, "q", (None, None, None))
    batch, num_q_heads, dim = q.shape
    centroids = float_input(centroids, "centroids", (batch, None, None, dim), q.dtype)
    num_kv_heads, num_clusters = centroids.shape[1], centroids.shape[2]
    group_size(num_q_heads, num_kv_heads)
    sizes = int_input(sizes, "sizes", (batch, num_kv_heads, num_clusters))
    scale = check_scale(scale)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= num_clusters:
        raise InvalidValueError(f"k: expected an integer in [0, {num_clusters}], got {k!r}")
    device = same_device(q=q, centroids=centroids, sizes=sizes)
    logits, top_ids = output_pair(
        out,
        ("logits", "top_ids"),
        ((batch, num_q_heads, num_clusters), (batch, num_kv_heads, k)),
        (torch.float32, torch.int64),
        device,
    )
    if resolve_backend(backend, device) == "triton":
        from vecstore.kernels._centroid_kernels import group_scores_triton

        score = group_scores_triton(q, centroids, sizes, scale, logits)
    else:
        all_logits, score = _group_scores_torch(q, centroids, sizes, scale)
        logits.copy_(all_logits)
    top_ids.copy_(select_top(score, k))
    return logits, top_ids


def select_top(score: torch.Tensor, k: int) -> torch.Tensor:
    """Return the ``k`` highest-scoring ids of each row, best first; ``-1`` for ``-inf`` scores.

    Parameters
    ----------
    score : torch.Tensor
        ``[..., C]`` float ranking score, ``-inf`` for ids that must not be selected.
    k : int
        Ids per row, ``0 <= k <= C``.

    Returns
    -------
    torch.Tensor
        ``[..., k]`` int64.
    """
    if not 0 <= k <= score.shape[-1]:
        raise ShapeError(f"k: expected 0 <= k <= {score.shape[-1]}, got {k}")
    values, ids = torch.topk(score, k, dim=-1, largest=True, sorted=True)
    return torch.where(torch.isneginf(values), torch.full_like(ids, -1), ids)


def _group_scores_torch(
    q: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch fallback: ``(logits [B, Hq, C] float32, score [B, Hkv, C] float32)``."""
    batch, num_q_heads, dim = q.shape
    num_kv_heads = centroids.shape[1]
    group = num_q_heads // num_kv_heads
    q_grouped = q.float().view(batch, num_kv_heads, group, dim)  # [B, Hkv, G, D]
    logits = torch.matmul(q_grouped, centroids.float().transpose(-1, -2)) * scale  # [B,Hkv,G,C]
    is_empty = (sizes <= 0).unsqueeze(2)  # [B, Hkv, 1, C]
    logits = logits.masked_fill(is_empty, float("-inf"))
    peak = logits.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isneginf(peak), torch.zeros_like(peak), peak)
    expo = torch.exp(logits - peak)
    denom = expo.sum(dim=-1, keepdim=True)
    probs = expo / torch.where(denom > 0, denom, torch.ones_like(denom))
    score = probs.sum(dim=2).masked_fill(is_empty.squeeze(2), float("-inf"))  # [B, Hkv, C]
    return logits.view(batch, num_q_heads, -1), score
