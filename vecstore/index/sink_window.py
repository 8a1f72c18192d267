"""StreamingLLM (Xiao et al. 2024): attention sinks plus the most recent tokens."""

from __future__ import annotations

import torch

from vecstore.config import StoreConfig
from vecstore.index.base import INDEXES, IndexView, Segment
from vecstore.index.pages import page_segment

__all__ = ["SinkWindowIndex"]


@INDEXES.register("sink_window")
class SinkWindowIndex:
    """Pages ranked by recency, so a retrieval budget extends the recent window.

    Examples
    --------
    >>> from vecstore.config import StoreConfig
    >>> (seg,) = SinkWindowIndex(StoreConfig()).build(torch.randn(1, 40, 4),
    ...                                               torch.randn(1, 40, 4), start=4)
    >>> seg.meta["last_position"].tolist()
    [[19.0, 35.0, 43.0]]
    """

    can_estimate = False
    is_exact = False

    def __init__(self, config: StoreConfig) -> None:
        self.page = config.index.page_tokens

    def build(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> list[Segment]:
        H, N, _ = keys.shape
        ends = torch.arange(self.page, N + self.page, self.page, device=keys.device).clamp_max(N)
        last = (start + ends - 1).float().expand(H, -1).contiguous()
        return [page_segment(keys, values, start, self.page, {"last_position": last})]

    def rank(self, view: IndexView, q: torch.Tensor, scale: float) -> torch.Tensor:
        return view.meta["last_position"].masked_fill(view.sizes == 0, float("-inf"))
