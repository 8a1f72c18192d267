"""The top-k oracle: the exact highest-scoring tokens, the ceiling for retrieval-only methods."""

from __future__ import annotations

import torch

from vecstore.config import StoreConfig
from vecstore.index.base import INDEXES, IndexView, Segment
from vecstore.index.pages import page_segment, sliced_group_softmax_rank

__all__ = ["TopkOracleIndex"]


@INDEXES.register("topk_oracle")
class TopkOracleIndex:
    """Every token is a unit; units ranked by their exact softmax weight summed over the
    GQA group and query tokens. It reads every key to rank, so it is a yardstick, not a
    method to deploy.

    Examples
    --------
    >>> from vecstore.config import StoreConfig
    >>> (seg,) = TopkOracleIndex(StoreConfig()).build(torch.randn(2, 5, 4), torch.randn(2, 5, 4), 0)
    >>> seg.num_units
    5
    """

    can_estimate = False
    is_exact = False

    def __init__(self, config: StoreConfig) -> None:
        del config

    def build(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> list[Segment]:
        return [page_segment(keys, values, start, 1)]

    def rank(self, view: IndexView, q: torch.Tensor, scale: float) -> torch.Tensor:
        keys = view.keys.float()
        return sliced_group_softmax_rank(
            lambda qs: torch.einsum("bhgld,bhnd->bhgln", qs, keys).mul_(scale), q, view.sizes)
