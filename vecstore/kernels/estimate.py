"""The estimation zone of tripartite attention: clusters approximated by centroid and value sum.

RetroInfer (Chen et al., 2025) approximates every key of cluster ``j`` by its centroid ``c_j``:
the zone's softmax numerator is ``sum_j e^(s q . c_j) VS_j`` and its denominator
``sum_j n_j e^(s q . c_j)``. Here that is computed in log space from the centroid logits that
:func:`vecstore.kernels.centroid_topk.score_centroids` already produced, and returned as an
attention state ``(out, lse)`` to be merged with the exact zones.
"""

from __future__ import annotations

import torch

from vecstore.kernels._backend import Backend, resolve_backend
from vecstore.kernels._validate import (
    float_input,
    group_size,
    int_input,
    same_device,
    state_outputs,
)

__all__ = ["estimate_zone"]


def estimate_zone(
    logits: torch.Tensor,
    sizes: torch.Tensor,
    value_sums: torch.Tensor,
    est_ids: torch.Tensor,
    *,
    backend: Backend = "auto",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention state of the estimated clusters, for one query token per sequence.

    For each query head and each valid estimated cluster ``j`` of its KV head, the weight is
    ``w_j = logits[j] + log(sizes[j])``; ``lse = logsumexp_j w_j`` and
    ``out = sum_j exp(w_j - lse) * value_sums[j] / sizes[j]``.

    Parameters
    ----------
    logits : torch.Tensor
        ``[B, Hq, C]`` float32 centroid logits ``s * q . c_j`` (``-inf`` excludes a cluster).
    sizes : torch.Tensor
        ``[B, Hkv, C]`` integer cluster sizes; a cluster of size ``<= 0`` is excluded.
    value_sums : torch.Tensor
        ``[B, Hkv, C, D]`` float32, float16 or bfloat16 sum of each cluster's values.
    est_ids : torch.Tensor
        ``[B, Hkv, E]`` integer ids of the clusters to estimate, distinct within a row; ``-1``
        (or any id outside ``[0, C)``) is padding and excluded.
    backend : {"auto", "triton", "torch"}
        ``"auto"`` runs Triton on CUDA tensors and torch otherwise.
    out : tuple of torch.Tensor, optional
        Preallocated ``(out, lse)`` to write (contiguous, same device, the shapes and dtypes
        below), e.g. for CUDA graphs; new tensors when omitted.

    Returns
    -------
    out : torch.Tensor
        ``[B, Hq, D]`` float32; 0 for a head with no valid cluster.
    lse : torch.Tensor
        ``[B, Hq]`` float32; ``-inf`` for a head with no valid cluster.

    Raises
    ------
    ShapeError
        If a shape, dtype or device does not match.
    InvalidValueError
        If ``backend`` is unknown.
    BackendUnavailableError
        If ``backend="triton"`` cannot run here.

    Examples
    --------
    >>> import torch
    >>> logits = torch.zeros(1, 1, 2)                        # B=1, Hq=1, C=2
    >>> sizes = torch.tensor([[[1, 3]]])
    >>> value_sums = torch.tensor([[[[4.0], [6.0]]]])        # D=1
    >>> out, lse = estimate_zone(logits, sizes, value_sums, torch.tensor([[[0, 1]]]))
    >>> round(out.item(), 4), round(lse.item(), 4)            # (4 + 6) / 4 tokens, log(4)
    (2.5, 1.3863)
    """
    logits = float_input(logits, "logits", (None, None, None), torch.float32)
    batch, num_q_heads, num_clusters = logits.shape
    sizes = int_input(sizes, "sizes", (batch, None, num_clusters))
    num_kv_heads = sizes.shape[1]
    group_size(num_q_heads, num_kv_heads)
    value_sums = float_input(value_sums, "value_sums", (batch, num_kv_heads, num_clusters, None))
    est_ids = int_input(est_ids, "est_ids", (batch, num_kv_heads, None))
    device = same_device(logits=logits, sizes=sizes, value_sums=value_sums, est_ids=est_ids)
    dim = value_sums.shape[-1]
    result, lse = state_outputs(out, batch, num_q_heads, dim, device)
    if resolve_backend(backend, device) == "triton":
        from vecstore.kernels._estimate_kernels import estimate_zone_triton

        estimate_zone_triton(logits, sizes, value_sums, est_ids, result, lse)
    else:
        torch_out, torch_lse = _estimate_zone_torch(logits, sizes, value_sums, est_ids)
        result.copy_(torch_out)
        lse.copy_(torch_lse)
    return result, lse


def _estimate_zone_torch(
    logits: torch.Tensor, sizes: torch.Tensor, value_sums: torch.Tensor, est_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch fallback with the semantics of :func:`estimate_zone`."""
    batch, num_q_heads, num_clusters = logits.shape
    num_kv_heads, num_ids = est_ids.shape[1], est_ids.shape[2]
    dim = value_sums.shape[-1]
    group = num_q_heads // num_kv_heads
    if num_clusters == 0 or num_ids == 0:
        out = torch.zeros(batch, num_q_heads, dim, device=logits.device)
        return out, torch.full((batch, num_q_heads), float("-inf"), device=logits.device)
    ids = est_ids.long()
    in_range = (ids >= 0) & (ids < num_clusters)
    safe_ids = torch.where(in_range, ids, torch.zeros_like(ids))  # [B, Hkv, E]
    counts = sizes.long().gather(-1, safe_ids)
    valid = in_range & (counts > 0)
    counts_f = torch.where(valid, counts, torch.ones_like(counts)).float()
    grouped = logits.view(batch, num_kv_heads, group, num_clusters)
    picked = grouped.gather(-1, safe_ids.unsqueeze(2).expand(-1, -1, group, -1))  # [B,Hkv,G,E]
    weights = (picked + counts_f.log().unsqueeze(2)).masked_fill(~valid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(weights, dim=-1)  # [B, Hkv, G]
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(weights - ref.unsqueeze(-1)) / counts_f.unsqueeze(2)  # [B, Hkv, G, E]
    gathered = value_sums.gather(2, safe_ids.unsqueeze(-1).expand(-1, -1, -1, dim)).float()
    gathered = gathered.masked_fill(~valid.unsqueeze(-1), 0.0)  # padding may hold NaN
    out = torch.matmul(probs, gathered)  # [B, Hkv, G, D]
    return out.view(batch, num_q_heads, dim), lse.view(batch, num_q_heads)
