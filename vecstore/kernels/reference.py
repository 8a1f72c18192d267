"""The torch reference of the decode kernels: exact attention, the estimation zone, the merge.

Plain torch on any device, computed in float32 (float64 for float64 inputs, which is how the
kernel tests use it). The torch executor (:mod:`vecstore.executor.torch_ref`) runs on it, and
every Triton kernel of this package is tested against it: the retrieved and steady zones'
attention against :func:`attend`, the estimation zone's against :func:`estimate`, the merge of
partial states against :func:`merge`. The ranking score's reference is the index's own
(:meth:`vecstore.index.wave.WaveIndex.rank`). :func:`attend` and :func:`estimate` soft-cap
their logits when given a ``softcap`` (:func:`softcap_`, Gemma 2's
``attn_logit_softcapping``).
"""

from __future__ import annotations

import torch

__all__ = ["attend", "estimate", "merge", "softcap_"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # float32 for 16- and 32-bit inputs, float64 for float64
    return torch.promote_types(x.dtype, torch.float32)


def softcap_(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Soft-cap attention logits in place, ``softcap * tanh(logits / softcap)`` (Gemma 2's
    ``attn_logit_softcapping``); ``None`` leaves them as they are. Returns ``logits``.

    The cap maps ``-inf`` to ``-softcap``: mask after capping.

    Examples
    --------
    >>> softcap_(torch.tensor([0.0, 1.0, 100.0]), 2.0).tolist()
    [0.0, 0.9242343306541443, 2.0]
    """
    if softcap is None:
        return logits
    return logits.div_(softcap).tanh_().mul_(softcap)


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of grouped queries over the valid rows of a key set.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hkv, G, L, D]`` queries.
    keys, values : torch.Tensor
        ``[B, Hkv, T, D]``.
    valid : torch.Tensor
        Bool, ``[B, Hkv, T]`` (the same rows for every query) or broadcastable to
        ``[B, Hkv, G, L, T]`` (a mask per query, e.g. causal); invalid rows get no weight
        (their keys may hold anything, their values must be finite).
    scale : float
        Softmax scale.
    softcap : float | None
        Logit soft-cap applied to the scaled scores (:func:`softcap_`); ``None``: none.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``out [B, Hkv, G, L, D]`` and ``lse [B, Hkv, G, L]``, float32 (float64 for float64
        ``q``); a query with no valid row has ``lse = -inf`` and ``out = 0``.

    Examples
    --------
    >>> q, k, v = torch.zeros(1, 1, 1, 1, 2), torch.randn(1, 1, 3, 2), torch.eye(3, 2)[None, None]
    >>> out, lse = attend(q, k, v, torch.tensor([[[True, True, False]]]), 1.0)
    >>> out.flatten().tolist(), round(float(lse), 4)  # equal scores: the mean of two rows
    ([0.5, 0.5], 0.6931)
    """
    dtype = _compute_dtype(q)
    mask = valid[:, :, None, None, :] if valid.dim() == 3 else valid
    # in place after the product: one [B, Hkv, G, L, T] tensor at a time
    logits = torch.einsum("bhgld,bhtd->bhglt", q.to(dtype), keys.to(dtype)).mul_(scale)
    softcap_(logits, softcap)
    logits.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = logits.sub_(lse[..., None]).exp_().nan_to_num_(0.0)
    return torch.einsum("bhglt,bhtd->bhgld", probs, values.to(dtype)), lse


def estimate(q: torch.Tensor, centroids: torch.Tensor, log_sizes: torch.Tensor,
             value_means: torch.Tensor, scale: float,
             softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over clusters whose every key is approximated by the cluster's centroid.

    Cluster ``j`` contributes ``n_j e^(s q . c_j)`` to the softmax denominator (a lower bound
    of its true mass, by Jensen) and ``e^(s q . c_j) VS_j = n_j e^(s q . c_j) VS_j / n_j`` to
    the numerator (RetroInfer, Chen et al., 2025): attention with logits
    ``s q . c_j + log n_j`` over the value means.

    With a logit ``softcap`` ``c`` the centroid's score is capped as a key's is,
    ``n_j e^(cap(s q . c_j))`` with ``cap(x) = c tanh(x / c)``: still the estimate of a
    cluster whose keys sit at their mean, but a lower bound only where Jensen applies, i.e.
    where ``e^(cap(x))`` is convex over the scores of the cluster's keys. It is convex for
    every ``x <= 0`` and for ``x > 0`` while ``sech^2(x / c) >= 2 tanh(x / c) / c`` (up to
    ``x ~ 2.3 c`` at ``c = 50``, ``1.16 c`` at ``c = 5``); a cluster with keys scoring past
    that may be overestimated.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hkv, G, L, D]`` queries.
    centroids : torch.Tensor
        ``[B, Hkv, E, D]`` the estimated clusters' centroids.
    log_sizes : torch.Tensor
        ``[B, Hkv, E]`` ``log n_j``; ``-inf`` excludes a cluster (padding).
    value_means : torch.Tensor
        ``[B, Hkv, E, D]`` ``VS_j / n_j``.
    scale : float
        Softmax scale.
    softcap : float | None
        Logit soft-cap of the centroid scores (:func:`softcap_`); ``None``: none.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``out [B, Hkv, G, L, D]`` and ``lse [B, Hkv, G, L]`` as :func:`attend` returns them.

    Examples
    --------
    >>> q, c = torch.zeros(1, 1, 1, 1, 2), torch.zeros(1, 1, 2, 2)
    >>> sizes = torch.tensor([[[1.0, 3.0]]])
    >>> out, lse = estimate(q, c, sizes.log(), torch.eye(2)[None, None], 1.0)
    >>> out.flatten().tolist(), round(float(lse.exp()), 4)  # weights 1 : 3, mass 4
    ([0.25, 0.75], 4.0)
    """
    dtype = _compute_dtype(q)
    logits = softcap_(scale * torch.einsum("bhgld,bhed->bhgle", q.to(dtype), centroids.to(dtype)),
                      softcap)
    logits += log_sizes.to(dtype)[:, :, None, None]
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits.sub_(lse[..., None])).nan_to_num_(0.0)
    return torch.einsum("bhgle,bhed->bhgld", probs, value_means.to(dtype)), lse


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint token sets into attention over their union.

    ``lse = logaddexp(lse_a, lse_b)``, ``out = e^(lse_a-lse) out_a + e^(lse_b-lse) out_b``;
    a side with ``lse = -inf`` (no tokens) contributes nothing, and two empty sides give
    ``lse = -inf``, ``out = 0``.

    Examples
    --------
    >>> o, l = merge(torch.ones(1, 2), torch.zeros(1), torch.zeros(1, 2), torch.zeros(1))
    >>> o.tolist(), round(float(l), 4)
    ([[0.5, 0.5]], 0.6931)
    >>> merge(torch.ones(1, 2), torch.tensor([float("-inf")]),
    ...       torch.ones(1, 2), torch.tensor([float("-inf")]))[0].tolist()
    [[0.0, 0.0]]
    """
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    wa = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse))
    wb = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse))
    return wa[..., None] * out_a + wb[..., None] * out_b, lse
