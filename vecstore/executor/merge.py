"""Exact attention over a token set, and the log-sum-exp merge of partial results."""

from __future__ import annotations

import torch

__all__ = ["attend", "merge"]


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of grouped queries over the valid rows of a key set, in float32.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, Hkv, G, L, D]`` queries.
    keys, values : torch.Tensor
        ``[B, Hkv, T, D]``.
    valid : torch.Tensor
        ``[B, Hkv, T]`` bool; invalid rows get no weight.
    scale : float
        Softmax scale.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``out [B, Hkv, G, L, D]`` and ``lse [B, Hkv, G, L]``, both float32; a query with
        no valid row has ``lse = -inf`` and ``out = 0``.
    """
    # in place after the product: one [B, Hkv, G, L, T] float32 tensor at a time
    logits = torch.einsum("bhgld,bhtd->bhglt", q.float(), keys.float()).mul_(scale)
    logits.masked_fill_(~valid[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = logits.sub_(lse[..., None]).exp_().nan_to_num_(0.0)
    return torch.einsum("bhglt,bhtd->bhgld", probs, values.float()), lse


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
