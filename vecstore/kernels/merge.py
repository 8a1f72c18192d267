"""Exact log-sum-exp merge of two attention states.

An attention state over a set of keys is ``(out, lse)``: the softmax-weighted mean of the values
and the log of the softmax denominator. Two states over disjoint key sets merge exactly:
``lse = logaddexp(lse_a, lse_b)``, ``out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b``.
An empty set has ``lse = -inf`` and ``out = 0``; merging with it is the identity.

This is plain torch (a few fused elementwise ops); a kernel would not pay for two ``[B, Hq, D]``
tensors.
"""

from __future__ import annotations

import torch

from vecstore.errors import ShapeError

__all__ = ["merge_states"]


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets.

    Parameters
    ----------
    out_a, out_b : torch.Tensor
        ``[..., D]`` normalised outputs of each state, any float dtype.
    lse_a, lse_b : torch.Tensor
        ``[...]`` log-sum-exp of each state (``-inf`` for an empty state), any float dtype.

    Returns
    -------
    out : torch.Tensor
        ``[..., D]`` float32 merged output; 0 where both states are empty.
    lse : torch.Tensor
        ``[...]`` float32 merged log-sum-exp; ``-inf`` where both states are empty.

    Raises
    ------
    ShapeError
        If the shapes do not agree.

    Examples
    --------
    >>> import torch
    >>> out, lse = merge_states(torch.ones(1, 2), torch.zeros(1),
    ...                         torch.zeros(1, 2), torch.tensor([float("-inf")]))
    >>> out.tolist(), lse.tolist()
    ([[1.0, 1.0]], [0.0])
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ShapeError(
            "merge_states: expected out_a, out_b of shape (..., D) and lse_a, lse_b of shape "
            f"(...), got {tuple(out_a.shape)}, {tuple(lse_a.shape)}, {tuple(out_b.shape)}, "
            f"{tuple(lse_b.shape)}"
        )
    lse_a = lse_a.float()
    lse_b = lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)
    # Where both are empty, subtract 0 instead of -inf so the weights are exp(-inf) = 0, not NaN.
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - ref).unsqueeze(-1)
    w_b = torch.exp(lse_b - ref).unsqueeze(-1)
    return w_a * out_a.float() + w_b * out_b.float(), lse
