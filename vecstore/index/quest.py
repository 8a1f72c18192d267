"""Quest (Tang et al. 2024): pages ranked by an upper bound of their largest score."""

from __future__ import annotations

import torch

from vecstore.config import StoreConfig
from vecstore.index.base import INDEXES, IndexView, Segment
from vecstore.index.pages import page_reduce, page_segment
from vecstore.slicing import query_slices

__all__ = ["QuestIndex"]


@INDEXES.register("quest")
class QuestIndex:
    """Per page, element-wise key min and max; ``Σ_d max(q_d·min_d, q_d·max_d)`` bounds
    every ``q·k`` in the page. Ranked by the bound's maximum over the GQA group and
    query tokens.

    Examples
    --------
    >>> from vecstore.config import StoreConfig
    >>> idx = QuestIndex(StoreConfig())
    >>> keys = torch.tensor([[[1.0, -2.0]] * 16 + [[3.0, 0.5]] * 16])
    >>> (seg,) = idx.build(keys, keys, 0)
    >>> seg.meta["kmax"][0].tolist()
    [[1.0, -2.0], [3.0, 0.5]]
    """

    can_estimate = False
    is_exact = False

    def __init__(self, config: StoreConfig) -> None:
        self.page = config.index.page_tokens

    def build(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> list[Segment]:
        kf = keys.float()
        meta = {"kmin": page_reduce(kf, self.page, "min"),
                "kmax": page_reduce(kf, self.page, "max")}
        return [page_segment(keys, values, start, self.page, meta)]

    def rank(self, view: IndexView, q: torch.Tensor, scale: float) -> torch.Tensor:
        kmin, kmax = view.meta["kmin"], view.meta["kmax"]
        B, H, G, L, D = q.shape
        bound = None  # [B, Hkv, C]; the [B, Hkv, G, l, C, D] products stay in budget
        for part in query_slices(L, kmin.shape[2] * D, rows=B * H * G):
            qs = q[:, :, :, part].float()
            lo = torch.einsum("bhgld,bhcd->bhglcd", qs, kmin)
            hi = torch.einsum("bhgld,bhcd->bhglcd", qs, kmax)
            best = torch.maximum(lo, hi).sum(-1).amax(dim=(2, 3))
            del lo, hi
            bound = best if bound is None else torch.maximum(bound, best)
        assert bound is not None
        return bound.masked_fill(view.sizes == 0, float("-inf"))
