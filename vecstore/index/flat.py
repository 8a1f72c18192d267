"""The exact index: every token is always attended."""

from __future__ import annotations

import torch

from vecstore.config import StoreConfig
from vecstore.index.base import INDEXES, IndexView, Segment
from vecstore.index.pages import page_segment

__all__ = ["FlatIndex"]


@INDEXES.register("flat")
class FlatIndex:
    """Pages in token order, all retrieved on every query: exact attention.

    Examples
    --------
    >>> from vecstore.config import StoreConfig
    >>> (seg,) = FlatIndex(StoreConfig()).build(torch.randn(1, 40, 4), torch.randn(1, 40, 4), 0)
    >>> seg.offsets.tolist()
    [[0, 16, 32, 40]]
    """

    can_estimate = False
    is_exact = True

    def __init__(self, config: StoreConfig) -> None:
        self.page = config.index.page_tokens

    def build(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> list[Segment]:
        return [page_segment(keys, values, start, self.page)]

    def rank(self, view: IndexView, q: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.zeros_like(view.sizes, dtype=torch.float32).masked_fill(
            view.sizes == 0, float("-inf"))
