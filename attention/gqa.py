"""Grouped-query attention (GQA) head bookkeeping.

With GQA (Ainslie et al. 2023) ``Hq`` query heads share ``Hkv`` key/value heads; query
head ``h`` reads KV head ``h // G`` where ``G = Hq // Hkv``, the layout Llama, Qwen2 and
Mistral use (``repeat_kv`` in transformers).
"""

from __future__ import annotations

import torch

from vecstore.errors import ShapeError

__all__ = ["group_size", "repeat_kv"]


def group_size(num_q_heads: int, num_kv_heads: int) -> int:
    """Query heads per KV head, ``G = Hq // Hkv``.

    Raises
    ------
    ShapeError
        If ``Hq`` is not a positive multiple of ``Hkv``.

    Examples
    --------
    >>> group_size(9, 3)
    3
    """
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ShapeError(f"query heads: expected a positive multiple of the {num_kv_heads} KV "
                         f"heads, got {num_q_heads}")
    return num_q_heads // num_kv_heads


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Repeat each KV head ``groups`` times so it lines up with its query heads.

    Parameters
    ----------
    x : torch.Tensor
        ``[B, Hkv, T, D]`` keys or values.
    groups : int
        ``G``, query heads per KV head.

    Returns
    -------
    torch.Tensor
        ``[B, Hkv * G, T, D]``; head ``h`` is KV head ``h // G``.

    Examples
    --------
    >>> repeat_kv(torch.arange(2.0).reshape(1, 2, 1, 1), 2).flatten().tolist()
    [0.0, 0.0, 1.0, 1.0]
    """
    if groups == 1:
        return x
    B, H, T, D = x.shape
    return x[:, :, None].expand(B, H, groups, T, D).reshape(B, H * groups, T, D)
