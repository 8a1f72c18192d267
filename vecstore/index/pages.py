"""Fixed-size pages in token order: the unit of the page-based baseline indexes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vecstore.index.base import Segment
from vecstore.slicing import query_slices

__all__ = ["page_segment", "group_softmax_rank", "sliced_group_softmax_rank"]


def page_segment(
    keys: torch.Tensor, values: torch.Tensor, start: int, page: int,
    meta: dict[str, torch.Tensor] | None = None,
) -> Segment:
    """A segment whose units are consecutive pages of ``page`` tokens (the last may be short)."""
    H, N, _ = keys.shape
    bounds = torch.arange(0, N, page, device=keys.device)
    offsets = torch.cat([bounds, bounds.new_tensor([N])]).expand(H, -1).contiguous()
    return Segment(start=start, end=start + N, keys=keys, values=values,
                   offsets=offsets, meta=meta or {})


def page_reduce(x: torch.Tensor, page: int, how: str) -> torch.Tensor:
    """Reduce ``[H, N, ...]`` over pages of ``page`` rows with ``min`` or ``max``."""
    H, N = x.shape[:2]
    pad = (-N) % page
    if pad:
        x = torch.cat([x, x[:, -1:].expand(H, pad, *x.shape[2:])], dim=1)
    x = x.reshape(H, -1, page, *x.shape[2:])
    return x.amin(2) if how == "min" else x.amax(2)


def group_softmax_rank(logits: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Rank units by softmax over units, summed over a GQA group and query tokens.

    Parameters
    ----------
    logits : torch.Tensor
        ``[B, Hkv, G, L, C]`` scaled scores.
    sizes : torch.Tensor
        ``[B, Hkv, C]``; units of size 0 get ``-inf``.
    """
    valid = (sizes > 0)[:, :, None, None, :]
    probs = torch.softmax(logits.masked_fill(~valid, float("-inf")), dim=-1)
    score = probs.nan_to_num(0.0).sum(dim=(2, 3))
    return score.masked_fill(sizes == 0, float("-inf"))


def sliced_group_softmax_rank(logits_of: Callable[[torch.Tensor], torch.Tensor],
                              q: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """:func:`group_softmax_rank` of ``logits_of(q)``, computed over slices of the query
    tokens so the ``[B, Hkv, G, L, C]`` logits are never held whole (the ranking sums over
    ``L``; see :mod:`vecstore.slicing`).

    Parameters
    ----------
    logits_of : Callable
        Maps float32 grouped queries ``[B, Hkv, G, l, D]`` to fresh scaled scores
        ``[B, Hkv, G, l, C]`` (modified in place here).
    q : torch.Tensor
        ``[B, Hkv, G, L, D]`` grouped queries (any float dtype; each slice is converted).
    sizes : torch.Tensor
        ``[B, Hkv, C]``; units of size 0 get ``-inf``.

    Examples
    --------
    >>> q, c = torch.randn(1, 2, 2, 5, 4), torch.randn(1, 2, 3, 4)
    >>> sizes = torch.tensor([[[2, 0, 1], [1, 1, 1]]])
    >>> fn = lambda x: torch.einsum("bhgld,bhcd->bhglc", x, c)
    >>> torch.allclose(sliced_group_softmax_rank(fn, q, sizes),
    ...                group_softmax_rank(fn(q), sizes), equal_nan=True)
    True
    """
    B, H, G, L, _ = q.shape
    invalid = (sizes <= 0)[:, :, None, None, :]
    score = None
    for part in query_slices(L, sizes.shape[-1], rows=B * H * G):
        logits = logits_of(q[:, :, :, part].float()).masked_fill_(invalid, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        del logits
        mass = probs.nan_to_num_(0.0).sum(dim=(2, 3))
        del probs
        score = mass if score is None else score.add_(mass)
    assert score is not None
    return score.masked_fill(sizes == 0, float("-inf"))
